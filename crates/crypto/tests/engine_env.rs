//! `CRYPTBLK_ENGINE` forces the engine. Its own test binary, because the variable is
//! process-wide and would race with measured choices in other tests.

use cryptblk_crypto::{default_engine_for, force_engine, CipherSpec, CryptoError, ENGINE_ENV};

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

    // vaes: forced where the CPU has VAES, and otherwise refused with what is missing.
    std::env::set_var(ENGINE_ENV, "vaes");
    match default_engine_for(&xts512) {
        Ok(engine) => {
            assert_eq!(engine.name(), "vaes");
            assert!(vaes_cpu(), "vaes forced on a CPU without VAES");
            // It has no AES-192-XTS either, and says it is its own limit.
            let err = default_engine_for(&xts384)
                .err()
                .expect("forced vaes accepted AES-192-XTS");
            assert!(matches!(err, CryptoError::Unsupported { .. }), "{err}");
            assert!(err.to_string().contains("vaes"), "{err}");
        }
        Err(err) => {
            assert!(!vaes_cpu(), "vaes refused on a CPU with VAES: {err}");
            assert!(matches!(err, CryptoError::Unsupported { .. }), "{err}");
            assert!(err.to_string().contains("vaes"), "{err}");
        }
    }

    std::env::set_var(ENGINE_ENV, "qat");
    let err = default_engine_for(&xts512)
        .err()
        .expect("unknown engine accepted");
    assert!(err.to_string().contains("qat"), "{err}");
    assert!(
        err.to_string().contains("vaes, openssl, rustcrypto"),
        "{err}"
    );

    std::env::remove_var(ENGINE_ENV);
    assert!(default_engine_for(&xts512).is_ok());

    // The program's own choice (the CLI's --crypto-engine) wins over the variable, and
    // `None` hands the choice back.
    std::env::set_var(ENGINE_ENV, "openssl");
    force_engine(Some("RustCrypto")).unwrap();
    assert_eq!(default_engine_for(&xts512).unwrap().name(), "rustcrypto");
    force_engine(Some("openssl")).unwrap();
    let err = default_engine_for(&xts384)
        .err()
        .expect("forced openssl accepted AES-192-XTS");
    assert!(err.to_string().contains("--crypto-engine"), "{err}");
    let err = force_engine(Some("qat")).unwrap_err();
    assert!(err.to_string().contains("qat"), "{err}");
    assert_eq!(
        default_engine_for(&xts512).unwrap().name(),
        "openssl",
        "a refused name changed the forced engine"
    );
    force_engine(None).unwrap();
    std::env::set_var(ENGINE_ENV, "rustcrypto");
    assert_eq!(default_engine_for(&xts512).unwrap().name(), "rustcrypto");

    // A list: each spec takes the first listed engine that runs it, in the list's order.
    let cbc = CipherSpec::parse_luks2("aes-cbc-essiv:sha256", 32).unwrap();
    std::env::set_var(ENGINE_ENV, "rustcrypto, openssl");
    assert_eq!(default_engine_for(&xts512).unwrap().name(), "rustcrypto");
    std::env::set_var(ENGINE_ENV, "openssl,rustcrypto");
    assert_eq!(default_engine_for(&xts512).unwrap().name(), "openssl");
    assert_eq!(default_engine_for(&xts384).unwrap().name(), "rustcrypto");
    std::env::set_var(ENGINE_ENV, "vaes,openssl");
    let first = default_engine_for(&xts512).unwrap().name();
    assert_eq!(first, if vaes_cpu() { "vaes" } else { "openssl" });
    assert_eq!(default_engine_for(&cbc).unwrap().name(), "openssl");
    // No listed engine runs it: every one says why.
    let err = default_engine_for(&xts384)
        .err()
        .expect("vaes,openssl accepted AES-192-XTS");
    assert!(err.to_string().contains("vaes,openssl"), "{err}");
    assert!(
        err.to_string().contains("openssl does not implement"),
        "{err}"
    );
    std::env::set_var(ENGINE_ENV, "openssl,qat");
    let err = default_engine_for(&xts512)
        .err()
        .expect("qat in a list accepted");
    assert!(err.to_string().contains("qat"), "{err}");
    force_engine(Some("vaes,rustcrypto")).unwrap();
    assert_eq!(default_engine_for(&cbc).unwrap().name(), "rustcrypto");
    assert!(force_engine(Some("rustcrypto,qat")).is_err());
    assert!(force_engine(Some(" , ")).is_err());
    assert_eq!(
        default_engine_for(&cbc).unwrap().name(),
        "rustcrypto",
        "a refused list changed the forced engines"
    );
    force_engine(None).unwrap();
    std::env::remove_var(ENGINE_ENV);
}

/// Asked independently of the engine.
fn vaes_cpu() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::arch::is_x86_feature_detected!("aes")
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("vaes")
        && std::arch::is_x86_feature_detected!("vpclmulqdq");
    #[cfg(not(target_arch = "x86_64"))]
    false
}
