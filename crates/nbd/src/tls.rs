//! TLS credentials in QEMU's `tls-creds-x509` directory layout, turned into a rustls server
//! configuration (the file handling lives in `cryptblk-tls`, shared with migration).

use crate::Error;
use cryptblk_tls::ClientAuth;
use rustls::ServerConfig;
use std::path::Path;
use std::sync::Arc;

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

impl TlsCreds {
    /// Loads `ca-cert.pem`, `server-cert.pem` and `server-key.pem` from `dir`; an error names
    /// the file that is missing or unusable.
    pub fn load(dir: &Path) -> Result<Self, Error> {
        let config = cryptblk_tls::server_config(dir, ClientAuth::Optional).map_err(|e| {
            Error::TlsCredentials {
                path: e.path,
                reason: e.reason,
            }
        })?;
        Ok(TlsCreds {
            config: Arc::new(config),
        })
    }
}
