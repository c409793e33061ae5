//! Elliptic-curve JWKs (RFC 7517/7518 6.2) as tang and clevis exchange them, converted to and
//! from OpenSSL points; and the RFC 7638 thumbprint that names a server key (`kid`).
use crate::base64url::{b64, b64_encode};
use openssl::bn::{BigNum, BigNumContext};
use openssl::ec::{EcGroup, EcKey, EcPoint, EcPointRef};
use openssl::nid::Nid;
use serde_json::{json, Value};

/// The public part of an EC JWK: curve name and base64url coordinates, as written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EcJwk {
    pub crv: String,
    pub x: String,
    pub y: String,
}

impl EcJwk {
    /// Reads `{"kty":"EC","crv":..,"x":..,"y":..}` (other members, a private `d` included,
    /// are ignored).
    pub fn parse(v: &Value) -> Result<EcJwk, String> {
        let s = |name: &str| {
            v.get(name)
                .and_then(Value::as_str)
                .map(str::to_owned)
                .ok_or_else(|| format!("the JWK has no \"{name}\" string"))
        };
        if s("kty")? != "EC" {
            return Err("the JWK is not an elliptic-curve key (kty EC)".into());
        }
        Ok(EcJwk {
            crv: s("crv")?,
            x: s("x")?,
            y: s("y")?,
        })
    }

    /// The curve, if cryptblk supports it (the NIST curves tang advertises).
    pub fn group(&self) -> Result<EcGroup, String> {
        let nid = match self.crv.as_str() {
            "P-256" => Nid::X9_62_PRIME256V1,
            "P-384" => Nid::SECP384R1,
            "P-521" => Nid::SECP521R1,
            other => {
                return Err(format!(
                    "curve \"{other}\" (tang uses P-256, P-384 or P-521)"
                ))
            }
        };
        EcGroup::from_curve_name(nid).map_err(|e| e.to_string())
    }

    /// The point, checked to lie on `group`'s curve (a point off the curve would leak key
    /// bits in the exchange).
    pub fn point(&self, group: &EcGroup) -> Result<EcPoint, String> {
        let coord = |name: &str, text: &str| {
            let bytes = b64(text).map_err(|e| format!("JWK {name}: {e}"))?;
            if bytes.len() != field_len(group) {
                return Err(format!(
                    "JWK {name} is {} bytes, not the curve's {}",
                    bytes.len(),
                    field_len(group)
                ));
            }
            BigNum::from_slice(&bytes).map_err(|e| e.to_string())
        };
        let (x, y) = (coord("x", &self.x)?, coord("y", &self.y)?);
        let key = EcKey::from_public_key_affine_coordinates(group, &x, &y)
            .map_err(|_| format!("the {} JWK's point is not on the curve", self.crv))?;
        key.check_key()
            .map_err(|_| format!("the {} JWK's point is not a valid public key", self.crv))?;
        key.public_key().to_owned(group).map_err(|e| e.to_string())
    }

    /// The JWK of `point` on `group`, coordinates padded to the field size as RFC 7518 asks.
    pub fn from_point(crv: &str, group: &EcGroup, point: &EcPointRef) -> Result<EcJwk, String> {
        let (x, y) = affine(group, point)?;
        Ok(EcJwk {
            crv: crv.to_owned(),
            x: b64_encode(&x),
            y: b64_encode(&y),
        })
    }

    /// The JWK tang's recovery endpoint takes: usable for the ECMR exchange.
    pub fn to_exchange_json(&self) -> Value {
        json!({"kty": "EC", "crv": self.crv, "x": self.x, "y": self.y,
               "alg": "ECMR", "key_ops": ["deriveKey"]})
    }

    /// The RFC 7638 thumbprint with SHA-256 (`S256`, clevis's default) or SHA-1 (`S1`, what
    /// older tang servers named keys by).
    pub fn thumbprint(&self, sha1: bool) -> String {
        // The required members in lexicographic order, no whitespace; serde_json escapes
        // whatever untrusted text the strings hold.
        let canonical = format!(
            "{{\"crv\":{},\"kty\":\"EC\",\"x\":{},\"y\":{}}}",
            Value::from(self.crv.as_str()),
            Value::from(self.x.as_str()),
            Value::from(self.y.as_str())
        );
        if sha1 {
            b64_encode(&openssl::sha::sha1(canonical.as_bytes()))
        } else {
            b64_encode(&openssl::sha::sha256(canonical.as_bytes()))
        }
    }
}

/// Bytes of one coordinate on `group` (66 for P-521).
pub(crate) fn field_len(group: &EcGroup) -> usize {
    (group.degree() as usize).div_ceil(8)
}

/// The affine coordinates of `point`, each padded to the field size.
pub(crate) fn affine(group: &EcGroup, point: &EcPointRef) -> Result<(Vec<u8>, Vec<u8>), String> {
    let mut ctx = BigNumContext::new().map_err(|e| e.to_string())?;
    let (mut x, mut y) = (
        BigNum::new().map_err(|e| e.to_string())?,
        BigNum::new().map_err(|e| e.to_string())?,
    );
    point
        .affine_coordinates(group, &mut x, &mut y, &mut ctx)
        .map_err(|e| e.to_string())?;
    let len = field_len(group) as i32;
    Ok((
        x.to_vec_padded(len).map_err(|e| e.to_string())?,
        y.to_vec_padded(len).map_err(|e| e.to_string())?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thumbprint_matches_rfc7638_style_vector() {
        // A P-256 key and its S256 thumbprint as `jose jwk thp -a S256` prints it.
        let jwk = EcJwk {
            crv: "P-256".into(),
            x: "f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU".into(),
            y: "x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0".into(),
        };
        assert_eq!(
            jwk.thumbprint(false),
            "oKIywvGUpTVTyxMQ3bwIIeQUudfr_CkLMjCE19ECD-U"
        );
        let group = jwk.group().unwrap();
        let point = jwk.point(&group).unwrap();
        assert_eq!(EcJwk::from_point("P-256", &group, &point).unwrap(), jwk);
    }

    #[test]
    fn off_curve_and_unknown_curves_are_errors() {
        let mut jwk = EcJwk {
            crv: "P-256".into(),
            x: "f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU".into(),
            y: "y_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0".into(),
        };
        let group = jwk.group().unwrap();
        assert!(jwk
            .point(&group)
            .err()
            .unwrap()
            .contains("not on the curve"));
        jwk.crv = "secp256k1".into();
        assert!(jwk.group().unwrap_err().contains("secp256k1"));
        assert!(EcJwk::parse(&json!({"kty": "RSA", "n": "x"})).is_err());
        assert!(EcJwk::parse(&json!({"kty": "EC", "crv": 5})).is_err());
    }
}
