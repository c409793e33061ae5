//! The tang pin's recovery, the McCallum-Relyea exchange. At bind time clevis made an
//! ephemeral key c and sealed the passphrase with the ECDH secret of C = cG and the server's
//! exchange key S = sG; C sits in the JWE header as `epk`. To recover cS = sC without telling
//! the server C: pick a fresh e, send X = C + eG, the server answers Y = sX = sC + eS, and
//! sC = Y - eS. The server never sees C or the secret; a stolen disk is useless without it.
use crate::error::{Result, TokenError};
use crate::jose::TangHeader;
use crate::jwk::{affine, EcJwk};
use openssl::bn::BigNumContext;
use openssl::ec::{EcGroup, EcKey, EcPoint};
use std::time::Duration;
use zeroize::Zeroizing;

/// The ECDH-ES shared secret (the x coordinate of sC) of the token's header, recovered
/// through the tang server named in it.
pub(crate) fn recover_shared_secret(
    h: &TangHeader,
    timeout: Duration,
) -> Result<Zeroizing<Vec<u8>>> {
    let malformed = |e: String| TokenError::Malformed(e);
    let (group, client, server) = keys(h)?;
    let crypto = |e: openssl::error::ErrorStack| malformed(format!("EC arithmetic failed: {e}"));
    let mut ctx = BigNumContext::new().map_err(crypto)?;

    let ephemeral = EcKey::generate(&group).map_err(crypto)?;
    let mut blinded = EcPoint::new(&group).map_err(crypto)?;
    blinded
        .add(&group, &client, ephemeral.public_key(), &mut ctx)
        .map_err(crypto)?;
    let request = EcJwk::from_point(&h.epk.crv, &group, &blinded).map_err(malformed)?;
    let body =
        serde_json::to_vec(&request.to_exchange_json()).map_err(|e| malformed(e.to_string()))?;
    let reply = crate::http::post(
        &h.url,
        &format!("/rec/{}", h.kid),
        "application/jwk+json",
        &body,
        timeout,
    )?;
    let refused = |reason: String| TokenError::Refused {
        url: h.url.clone(),
        reason,
    };
    match reply.status {
        200 => {}
        // tangd answers 404 when it holds no key with that thumbprint.
        404 => {
            return Err(TokenError::ServerKeyGone {
                url: h.url.clone(),
                kid: h.kid.clone(),
            })
        }
        _ => return Err(refused(format!("it answered \"{}\"", reply.status_line))),
    }
    let reply: serde_json::Value = serde_json::from_slice(&reply.body)
        .map_err(|e| refused(format!("the answer is not JSON: {e}")))?;
    let reply =
        EcJwk::parse(&reply).map_err(|e| refused(format!("the answer is not a key: {e}")))?;
    if reply.crv != h.epk.crv {
        return Err(refused(format!(
            "the answer is on {}, not {}",
            reply.crv, h.epk.crv
        )));
    }
    let answered = reply
        .point(&group)
        .map_err(|e| refused(format!("the answer: {e}")))?;

    // sC = Y - eS.
    let mut es = EcPoint::new(&group).map_err(crypto)?;
    es.mul2(&group, &server, ephemeral.private_key(), &mut ctx)
        .map_err(crypto)?;
    es.invert2(&group, &mut ctx).map_err(crypto)?;
    let mut shared = EcPoint::new(&group).map_err(crypto)?;
    shared
        .add(&group, &answered, &es, &mut ctx)
        .map_err(crypto)?;
    if shared.is_infinity(&group) {
        return Err(TokenError::WrongServerKey { url: h.url.clone() });
    }
    let (x, y) = affine(&group, &shared).map_err(malformed)?;
    drop(Zeroizing::new(y));
    Ok(Zeroizing::new(x))
}

/// Checks the header's keys: a supported curve, the client key on it, the server key `kid`
/// names in the advertisement.
pub(crate) fn check_keys(h: &TangHeader) -> Result<()> {
    keys(h).map(drop)
}

/// The curve, the client's public key C and the server's exchange key S.
fn keys(h: &TangHeader) -> Result<(EcGroup, EcPoint, EcPoint)> {
    let group = h.epk.group().map_err(TokenError::Unsupported)?;
    let client = h
        .epk
        .point(&group)
        .map_err(|e| TokenError::Malformed(format!("epk: {e}")))?;
    let server = server_key(h, &group)?;
    Ok((group, client, server))
}

/// The server's exchange key the token names by `kid`, from the advertisement stored with
/// the token (its thumbprint by SHA-256, or SHA-1 as older tang servers named keys).
fn server_key(h: &TangHeader, group: &EcGroup) -> Result<EcPoint> {
    let found = h.adv_keys.iter().find_map(|key| {
        let jwk = EcJwk::parse(key).ok()?;
        (jwk.thumbprint(false) == h.kid || jwk.thumbprint(true) == h.kid).then_some(jwk)
    });
    let jwk = found.ok_or_else(|| {
        TokenError::Malformed(format!(
            "no key in clevis.tang.adv has the thumbprint kid \"{}\"",
            h.kid
        ))
    })?;
    if jwk.crv != h.epk.crv {
        return Err(TokenError::Malformed(format!(
            "the server key is on {}, the epk on {}",
            jwk.crv, h.epk.crv
        )));
    }
    jwk.point(group)
        .map_err(|e| TokenError::Malformed(format!("the server key: {e}")))
}
