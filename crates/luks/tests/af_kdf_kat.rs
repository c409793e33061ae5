//! Known-answer tests for the KDFs and the AF splitter.
use cryptblk_crypto::SecretKey;
use cryptblk_luks::af::{af_merge, af_split};
use cryptblk_luks::kdf::{derive, Argon2Variant, Kdf};
use cryptblk_luks::HashAlg;

fn pbkdf2(hash: HashAlg, pw: &[u8], salt: &[u8], iterations: u32, len: usize) -> String {
    hex::encode(
        derive(&Kdf::Pbkdf2 { hash, iterations }, pw, salt, len)
            .unwrap()
            .as_bytes(),
    )
}

#[test]
fn pbkdf2_sha1_rfc6070() {
    assert_eq!(
        pbkdf2(HashAlg::Sha1, b"password", b"salt", 1, 20),
        "0c60c80f961f0e71f3a9b524af6012062fe037a6"
    );
    assert_eq!(
        pbkdf2(HashAlg::Sha1, b"password", b"salt", 2, 20),
        "ea6c014dc72d6f8ccd1ed92ace1d41f0d8de8957"
    );
    assert_eq!(
        pbkdf2(HashAlg::Sha1, b"password", b"salt", 4096, 20),
        "4b007901b765489abead49d926f721d065a429c1"
    );
    assert_eq!(
        pbkdf2(
            HashAlg::Sha1,
            b"passwordPASSWORDpassword",
            b"saltSALTsaltSALTsaltSALTsaltSALTsalt",
            4096,
            25
        ),
        "3d2eec4fe41c849b80c8d83662c0e44a8b291a964cf2f07038"
    );
    assert_eq!(
        pbkdf2(HashAlg::Sha1, b"pass\0word", b"sa\0lt", 4096, 16),
        "56fa6aa75548099dcc37d7f03425e0c3"
    );
}

#[test]
fn pbkdf2_sha256_and_sha512() {
    assert_eq!(
        pbkdf2(HashAlg::Sha256, b"password", b"salt", 1, 32),
        "120fb6cffcf8b32c43e7225256c4f837a86548c92ccc35480805987cb70be17b"
    );
    assert_eq!(
        pbkdf2(HashAlg::Sha256, b"password", b"salt", 4096, 32),
        "c5e478d59288c841aa530db6845c4c8d962893a001ce4e11a4963873aa98134a"
    );
    assert_eq!(
        pbkdf2(HashAlg::Sha512, b"password", b"salt", 1, 64),
        "867f70cf1ade02cff3752599a3a53dc4af34c7a669815ae5d513554e1c8cf252\
         c02d470a285a0501bad999bfe943c08f050235d7d68b1da55e63f73b60a57fce"
    );
}

#[test]
fn pbkdf2_matches_openssl_cli() {
    // An independent implementation for the long-output case LUKS uses (64-byte keys over a
    // 20-byte PRF: several PBKDF2 blocks).
    let out = std::process::Command::new("openssl")
        .args([
            "kdf",
            "-keylen",
            "64",
            "-kdfopt",
            "digest:SHA1",
            "-kdfopt",
            "pass:compatkey",
            "-kdfopt",
            "hexsalt:00112233445566778899aabbccddeeff",
            "-kdfopt",
            "iter:1000",
            "PBKDF2",
        ])
        .output()
        .expect("the openssl command is required for this test");
    assert!(
        out.status.success(),
        "openssl kdf failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let expect = String::from_utf8(out.stdout)
        .unwrap()
        .trim()
        .replace(':', "")
        .to_lowercase();
    let salt = hex::decode("00112233445566778899aabbccddeeff").unwrap();
    assert_eq!(pbkdf2(HashAlg::Sha1, b"compatkey", &salt, 1000, 64), expect);
}

#[test]
fn argon2_reference_vectors() {
    // From the Argon2 reference implementation's test suite (version 0x13, t=2, m=64 MiB, p=1).
    let run = |variant| {
        let kdf = Kdf::Argon2 {
            variant,
            time: 2,
            memory_kib: 65536,
            parallel: 1,
        };
        hex::encode(
            derive(&kdf, b"password", b"somesalt", 32)
                .unwrap()
                .as_bytes(),
        )
    };
    assert_eq!(
        run(Argon2Variant::Argon2i),
        "c1628832147d9720c5bd1cfd61367078729f6dfb6f8fea9ff98158e0d7816ed0"
    );
    assert_eq!(
        run(Argon2Variant::Argon2id),
        "09316115d5cf24ed5a15a31a3ba326e5cf32edc24702987c02b6566f61913cf7"
    );
}

#[test]
fn argon2_rejects_bad_parameters_without_panicking() {
    let kdf = Kdf::Argon2 {
        variant: Argon2Variant::Argon2id,
        time: 0,
        memory_kib: 8,
        parallel: 0,
    };
    assert!(derive(&kdf, b"pw", b"somesaltsomesalt", 32).is_err());
    // argon2 refuses salts under 8 bytes; that must be an error, not a panic.
    let kdf = Kdf::Argon2 {
        variant: Argon2Variant::Argon2i,
        time: 1,
        memory_kib: 32,
        parallel: 1,
    };
    assert!(derive(&kdf, b"pw", b"x", 32).is_err());
}

/// The AF merge of a fixed input, computed by hand-independent means: the diffuser is
/// `H(be32(i) || block_i)` truncated; with 2 stripes, key = diffuse(s0) ^ s1.
#[test]
fn af_merge_two_stripes_known_answer() {
    use sha2::Digest;
    let s0: Vec<u8> = (0u8..40).collect();
    let s1 = vec![0u8; 40];
    let mut material = s0.clone();
    material.extend_from_slice(&s1);
    // Independent diffuser with sha256 directly: a 32-byte piece and an 8-byte tail.
    let mut expect = Vec::new();
    let h0 = sha2::Sha256::new()
        .chain_update(0u32.to_be_bytes())
        .chain_update(&s0[..32])
        .finalize();
    expect.extend_from_slice(&h0);
    let h1 = sha2::Sha256::new()
        .chain_update(1u32.to_be_bytes())
        .chain_update(&s0[32..])
        .finalize();
    expect.extend_from_slice(&h1[..8]);
    let key = af_merge(&material, 40, 2, HashAlg::Sha256);
    assert_eq!(key.as_bytes(), &expect[..]);
}

#[test]
fn af_round_trip_luks_sizes() {
    let key = SecretKey::random(64).unwrap();
    let m = af_split(&key, 4000, HashAlg::Sha512).unwrap();
    assert_eq!(af_merge(&m, 64, 4000, HashAlg::Sha512), key);
    assert_ne!(af_merge(&m, 64, 4000, HashAlg::Sha256), key);
}
