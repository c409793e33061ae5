//! TLS credentials in QEMU's `tls-creds-x509` directory layout, turned into a rustls server
//! configuration (the file handling lives in `cryptblk-tls`, shared with migration).

use crate::Error;
use cryptblk_tls::AllowList;
use rustls::ServerConfig;
use std::path::Path;
use std::sync::Arc;

/// Server credentials: the certificate chain and key the server proves itself with, and the
/// CA that client certificates must chain to.
///
/// Every client must present a certificate signed by the CA (QEMU: `tls-creds-x509` with
/// `client-cert.pem` and `client-key.pem` in the client's directory); with an allow-list
/// ([`with_authz`](Self::with_authz)) the certificate must also name a listed peer.
#[derive(Clone)]
pub struct TlsCreds {
    pub(crate) config: Arc<ServerConfig>,
    pub(crate) authz: Option<Arc<AllowList>>,
}

impl std::fmt::Debug for TlsCreds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsCreds").finish_non_exhaustive()
    }
}

impl TlsCreds {
    /// Loads `ca-cert.pem`, `server-cert.pem` and `server-key.pem` from `dir`; an error names
    /// the file that is missing or unusable.
    pub fn load(dir: &Path) -> Result<Self, Error> {
        let config = cryptblk_tls::server_config(dir).map_err(|e| Error::TlsCredentials {
            path: e.path,
            reason: e.reason,
        })?;
        Ok(TlsCreds {
            config: Arc::new(config),
            authz: None,
        })
    }

    /// Admits only clients whose certificate names someone on `list` (its subject CN or a
    /// DNS subjectAltName), to every export that has no list of its own
    /// ([`Export::tls_authz`](crate::Export::tls_authz)).
    pub fn with_authz(mut self, list: AllowList) -> Self {
        self.authz = Some(Arc::new(list));
        self
    }
}
