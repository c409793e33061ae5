//! The JOSE pieces of a clevis token, as parsed from the LUKS2 header: the flattened JWE and
//! what its protected header says for the tang pin.
use crate::jwk::EcJwk;
use serde_json::Value;

/// The parts of a flattened JWE (RFC 7516 7.2.2) a single-recipient `dir`-style JWE has.
#[derive(Debug, Clone)]
pub(crate) struct FlattenedJwe {
    /// The protected header as stored (base64url text): the AAD covers these exact bytes.
    pub protected: String,
    pub aad: Option<String>,
    pub iv: Vec<u8>,
    pub ciphertext: Vec<u8>,
    pub tag: Vec<u8>,
}

/// What the protected header says, for the tang pin.
#[derive(Debug, Clone)]
pub(crate) struct TangHeader {
    pub enc: String,
    pub epk: EcJwk,
    pub kid: String,
    pub apu: Vec<u8>,
    pub apv: Vec<u8>,
    pub url: String,
    /// The advertised keys (`clevis.tang.adv.keys`), one of which `kid` names.
    pub adv_keys: Vec<Value>,
}
