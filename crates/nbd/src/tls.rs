//! TLS credentials in QEMU's `tls-creds-x509` directory layout, turned into a rustls server
//! configuration.

use crate::Error;
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::Path;
use std::sync::Arc;

pub const CA_CERT_FILE: &str = "ca-cert.pem";
pub const SERVER_CERT_FILE: &str = "server-cert.pem";
pub const SERVER_KEY_FILE: &str = "server-key.pem";

/// Server credentials: the certificate chain and key the server proves itself with, and the
/// CA that client certificates must chain to.
///
/// Client certificates are verified when a client presents one but are not required: QEMU
/// clients configured with only `ca-cert.pem` (the common case) must be able to connect.
#[derive(Clone)]
pub struct TlsCreds {
    pub(crate) config: Arc<ServerConfig>,
}

impl std::fmt::Debug for TlsCreds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsCreds").finish_non_exhaustive()
    }
}

fn bad_file(path: &Path, reason: impl std::fmt::Display) -> Error {
    Error::TlsCredentials {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

fn read_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, Error> {
    if !path.exists() {
        return Err(bad_file(path, "missing"));
    }
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad_file(path, format!("cannot read certificates: {e}")))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad_file(path, format!("not a valid PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(bad_file(path, "contains no PEM certificate"));
    }
    Ok(certs)
}

impl TlsCreds {
    /// Loads `ca-cert.pem`, `server-cert.pem` and `server-key.pem` from `dir`; an error names
    /// the file that is missing or unusable.
    pub fn load(dir: &Path) -> Result<Self, Error> {
        let ca_path = dir.join(CA_CERT_FILE);
        let cert_path = dir.join(SERVER_CERT_FILE);
        let key_path = dir.join(SERVER_KEY_FILE);

        let mut roots = RootCertStore::empty();
        for cert in read_certificates(&ca_path)? {
            roots
                .add(cert)
                .map_err(|e| bad_file(&ca_path, format!("unusable CA certificate: {e}")))?;
        }
        let chain = read_certificates(&cert_path)?;
        if !key_path.exists() {
            return Err(bad_file(&key_path, "missing"));
        }
        let key = PrivateKeyDer::from_pem_file(&key_path)
            .map_err(|e| bad_file(&key_path, format!("no usable PEM private key: {e}")))?;

        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let client_verifier =
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots), Arc::clone(&provider))
                .allow_unauthenticated()
                .build()
                .map_err(|e| bad_file(&ca_path, format!("cannot verify clients with it: {e}")))?;
        let config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_client_cert_verifier(client_verifier)
            .with_single_cert(chain, key)
            .map_err(|e| {
                bad_file(
                    &cert_path,
                    format!("certificate does not match {SERVER_KEY_FILE} or is unusable: {e}"),
                )
            })?;
        Ok(TlsCreds {
            config: Arc::new(config),
        })
    }
}
