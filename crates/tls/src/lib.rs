//! x509 credentials in QEMU's `tls-creds-x509` directory layout (`ca-cert.pem`,
//! `server-cert.pem`, `server-key.pem`, `client-cert.pem`, `client-key.pem`), turned into rustls
//! configurations, and the names a peer's certificate carries ([`certificate_names`]) for the
//! allow-lists ([`AllowList`]) the NBD server and migration check them against. Shared by the
//! NBD server and the migration channels (each with its own credentials directory, and its own
//! CA where possible) and compatible with QEMU's.
//!
//! Every server this crate configures requires a client certificate signed by the CA: a
//! client without one fails the TLS handshake.

#![forbid(unsafe_code)]

mod names;

pub use names::{certificate_names, AllowList, AllowListError, CertificateNames};

use rustls::client::WebPkiServerVerifier;
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use rustls;

pub const CA_CERT_FILE: &str = "ca-cert.pem";
pub const SERVER_CERT_FILE: &str = "server-cert.pem";
pub const SERVER_KEY_FILE: &str = "server-key.pem";
pub const CLIENT_CERT_FILE: &str = "client-cert.pem";
pub const CLIENT_KEY_FILE: &str = "client-key.pem";

/// A credentials file that is missing or unusable; the message names it and says why.
#[derive(Debug, thiserror::Error)]
#[error("{}: {reason}", path.display())]
pub struct CredentialsError {
    pub path: PathBuf,
    pub reason: String,
}

fn bad_file(path: &Path, reason: impl std::fmt::Display) -> CredentialsError {
    CredentialsError {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

/// Reads every PEM certificate in `path` (at least one).
pub fn read_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, CredentialsError> {
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

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, CredentialsError> {
    if !path.exists() {
        return Err(bad_file(path, "missing"));
    }
    PrivateKeyDer::from_pem_file(path)
        .map_err(|e| bad_file(path, format!("no usable PEM private key: {e}")))
}

fn read_roots(dir: &Path) -> Result<Arc<RootCertStore>, CredentialsError> {
    let ca_path = dir.join(CA_CERT_FILE);
    let mut roots = RootCertStore::empty();
    for cert in read_certificates(&ca_path)? {
        roots
            .add(cert)
            .map_err(|e| bad_file(&ca_path, format!("unusable CA certificate: {e}")))?;
    }
    Ok(Arc::new(roots))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A server configuration from `ca-cert.pem`, `server-cert.pem` and `server-key.pem` in
/// `dir`; an error names the file that is missing or unusable. Clients must present a
/// certificate signed by `ca-cert.pem` (QEMU's `verify-peer=on`): a client without one, or
/// with one from another CA, fails the handshake.
pub fn server_config(dir: &Path) -> Result<ServerConfig, CredentialsError> {
    let ca_path = dir.join(CA_CERT_FILE);
    let cert_path = dir.join(SERVER_CERT_FILE);
    let roots = read_roots(dir)?;
    let chain = read_certificates(&cert_path)?;
    let key = read_key(&dir.join(SERVER_KEY_FILE))?;
    let provider = provider();
    let client_verifier = WebPkiClientVerifier::builder_with_provider(roots, Arc::clone(&provider))
        .build()
        .map_err(|e| bad_file(&ca_path, format!("cannot verify clients with it: {e}")))?;
    ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| bad_file(dir, format!("no usable TLS protocol version: {e}")))?
        .with_client_cert_verifier(client_verifier)
        .with_single_cert(chain, key)
        .map_err(|e| {
            bad_file(
                &cert_path,
                format!("certificate does not match {SERVER_KEY_FILE} or is unusable: {e}"),
            )
        })
}

/// A client configuration that verifies servers against `ca-cert.pem` and proves itself with
/// `client-cert.pem` and `client-key.pem` from `dir`.
pub fn client_config(dir: &Path) -> Result<ClientConfig, CredentialsError> {
    let ca_path = dir.join(CA_CERT_FILE);
    let cert_path = dir.join(CLIENT_CERT_FILE);
    let roots = read_roots(dir)?;
    let chain = read_certificates(&cert_path)?;
    let key = read_key(&dir.join(CLIENT_KEY_FILE))?;
    let provider = provider();
    let verifier = WebPkiServerVerifier::builder_with_provider(roots, Arc::clone(&provider))
        .build()
        .map_err(|e| bad_file(&ca_path, format!("cannot verify servers with it: {e}")))?;
    ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| bad_file(dir, format!("no usable TLS protocol version: {e}")))?
        .with_webpki_verifier(verifier)
        .with_client_auth_cert(chain, key)
        .map_err(|e| {
            bad_file(
                &cert_path,
                format!("certificate does not match {CLIENT_KEY_FILE} or is unusable: {e}"),
            )
        })
}
