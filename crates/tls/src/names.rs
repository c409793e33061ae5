//! Who a peer's certificate names, and lists of the names allowed in (QEMU's `tls-authz`).
//!
//! A certificate is matched by its subject's common names (CN) and its subjectAltName DNS
//! names: a CN must equal a listed name exactly, a DNS name equals it ignoring ASCII case (as
//! DNS does). No wildcards, no other name types: a list entry means one peer.
//!
//! Names are only read from a certificate the TLS handshake has already verified against the
//! CA, so what they say was vouched for by the CA.

use openssl::nid::Nid;
use openssl::x509::X509;
use std::fmt;
use std::path::{Path, PathBuf};

/// The names a certificate carries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CertificateNames {
    /// The subject's common names (usually one).
    pub common_names: Vec<String>,
    /// The subjectAltName DNS names.
    pub dns_names: Vec<String>,
}

impl fmt::Display for CertificateNames {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self
            .common_names
            .iter()
            .map(|n| format!("CN={n}"))
            .chain(self.dns_names.iter().map(|n| format!("DNS:{n}")))
            .collect();
        if parts.is_empty() {
            f.write_str("no CN or DNS name")
        } else {
            f.write_str(&parts.join(", "))
        }
    }
}

/// The names in a DER certificate; `None` if it cannot be parsed (a certificate that passed
/// verification always can).
pub fn certificate_names(der: &[u8]) -> Option<CertificateNames> {
    let cert = X509::from_der(der).ok()?;
    // UTF8String and PrintableString CNs (what every tool writes) are UTF-8 bytes; a name in
    // another encoding matches nothing.
    let text = |data: &openssl::asn1::Asn1StringRef| {
        String::from_utf8(data.as_slice().to_vec()).unwrap_or_default()
    };
    let common_names = cert
        .subject_name()
        .entries_by_nid(Nid::COMMONNAME)
        .map(|entry| text(entry.data()))
        .filter(|name| !name.is_empty())
        .collect();
    let dns_names = cert
        .subject_alt_names()
        .map(|names| {
            names
                .iter()
                .filter_map(|n| n.dnsname().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    Some(CertificateNames {
        common_names,
        dns_names,
    })
}

/// An allow-list entry that cannot be a certificate name, or a list file that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum AllowListError {
    #[error("the list of allowed certificate names is empty")]
    Empty,
    #[error("'{0}' is not a certificate name: names have no spaces at either end and no control characters")]
    BadName(String),
    #[error("{}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The certificate names allowed to connect (QEMU's `tls-authz` with a list of names).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowList {
    names: Vec<String>,
}

impl AllowList {
    /// Names separated by commas or newlines; blank entries and lines starting with `#` are
    /// skipped. At least one name.
    pub fn parse(text: &str) -> Result<AllowList, AllowListError> {
        Self::new(
            text.lines()
                .filter(|line| !line.trim_start().starts_with('#'))
                .flat_map(|line| line.split(','))
                .map(str::trim)
                .filter(|name| !name.is_empty()),
        )
    }

    /// A list of the given names (at least one).
    pub fn new<S: AsRef<str>>(names: impl IntoIterator<Item = S>) -> Result<Self, AllowListError> {
        let mut list = Vec::new();
        for name in names {
            let name = name.as_ref();
            if name.is_empty() || name.trim() != name || name.chars().any(char::is_control) {
                return Err(AllowListError::BadName(name.to_string()));
            }
            if !list.iter().any(|n| n == name) {
                list.push(name.to_string());
            }
        }
        if list.is_empty() {
            return Err(AllowListError::Empty);
        }
        Ok(AllowList { names: list })
    }

    /// One name per line (or comma-separated) in `path`, as [`parse`](Self::parse).
    pub fn from_file(path: &Path) -> Result<AllowList, AllowListError> {
        let text = std::fs::read_to_string(path).map_err(|source| AllowListError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text)
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The listed name `cert` carries, if any.
    pub fn admits(&self, cert: &CertificateNames) -> Option<&str> {
        self.names
            .iter()
            .find(|allowed| {
                cert.common_names.iter().any(|cn| cn == *allowed)
                    || cert
                        .dns_names
                        .iter()
                        .any(|dns| dns.eq_ignore_ascii_case(allowed))
            })
            .map(String::as_str)
    }

    /// The names of the verified certificate chain `peer` presented (its first certificate)
    /// checked against the list: the listed name it carries, or an error saying which names it
    /// had, for the log line of the refusal.
    pub fn check(
        &self,
        peer: Option<&[rustls_pki_types::CertificateDer<'_>]>,
    ) -> Result<String, String> {
        let Some(leaf) = peer.and_then(|chain| chain.first()) else {
            return Err("it presented no certificate".into());
        };
        let Some(names) = certificate_names(leaf) else {
            return Err("its certificate cannot be parsed".into());
        };
        match self.admits(&names) {
            Some(name) => Ok(name.to_string()),
            None => Err(format!(
                "its certificate ({names}) names nobody on the allow-list ({})",
                self.names.join(", ")
            )),
        }
    }
}

impl fmt::Display for AllowList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.names.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert(cns: &[&str], dns: &[&str]) -> CertificateNames {
        CertificateNames {
            common_names: cns.iter().map(|s| s.to_string()).collect(),
            dns_names: dns.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn names_match_by_cn_exactly_and_by_dns_ignoring_case() {
        let list = AllowList::parse("# hosts allowed\nvm1-client, Backup.Example.org\n\n").unwrap();
        assert_eq!(list.names(), ["vm1-client", "Backup.Example.org"]);
        assert_eq!(list.admits(&cert(&["vm1-client"], &[])), Some("vm1-client"));
        assert_eq!(list.admits(&cert(&["VM1-client"], &[])), None);
        assert_eq!(
            list.admits(&cert(&["x"], &["backup.example.org"])),
            Some("Backup.Example.org")
        );
        // No wildcard or partial matching: a list entry is one peer.
        assert_eq!(
            list.admits(&cert(&["vm1-client2"], &["*.example.org"])),
            None
        );
        assert_eq!(list.admits(&cert(&[], &[])), None);
    }

    #[test]
    fn bad_lists_are_refused_by_what_is_wrong() {
        assert!(matches!(
            AllowList::parse(" , \n# x"),
            Err(AllowListError::Empty)
        ));
        assert!(matches!(
            AllowList::new(["ok", " padded"]),
            Err(AllowListError::BadName(n)) if n == " padded"
        ));
        assert!(matches!(
            AllowList::new(["a\tb"]),
            Err(AllowListError::BadName(_))
        ));
        assert_eq!(AllowList::new(["a", "a", "b"]).unwrap().to_string(), "a,b");
    }
}
