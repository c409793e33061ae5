//! `CRYPTBLK_ENGINE` forces the engine. Its own test binary, because the variable is
//! process-wide and would race with measured choices in other tests.

use cryptblk_crypto::{default_engine_for, CipherSpec, CryptoError, ENGINE_ENV};

#[test]
fn env_var_forces_engine_and_rejects_unknown_or_unsupported() {
    let xts512 = CipherSpec::parse_luks2("aes-xts-plain64", 64).unwrap();
    let xts384 = CipherSpec::parse_luks2("aes-xts-plain64", 48).unwrap();

    std::env::set_var(ENGINE_ENV, "rustcrypto");
    assert_eq!(default_engine_for(&xts512).unwrap().name(), "rustcrypto");

    std::env::set_var(ENGINE_ENV, "OpenSSL");
    assert_eq!(default_engine_for(&xts512).unwrap().name(), "openssl");
    // OpenSSL has no AES-192-XTS: forcing it must say so rather than silently switch.
    let err = default_engine_for(&xts384)
        .err()
        .expect("forced openssl accepted AES-192-XTS");
    assert!(matches!(err, CryptoError::Unsupported { .. }), "{err}");

    std::env::set_var(ENGINE_ENV, "qat");
    let err = default_engine_for(&xts512)
        .err()
        .expect("unknown engine accepted");
    assert!(err.to_string().contains("qat"), "{err}");

    std::env::remove_var(ENGINE_ENV);
    assert!(default_engine_for(&xts512).is_ok());
}
