//! Known-answer tests run against every engine through the public `SectorCipher` API.

use cryptblk_crypto::{engines, CipherSpec, Direction, Engine, SecretKey};
use std::sync::Arc;

/// IEEE 1619-2007 Annex B data units: plaintext is the bytes 00..ff twice.
fn counting_512() -> Vec<u8> {
    (0..512usize).map(|i| i as u8).collect()
}

/// IEEE 1619-2007 vector 4: XTS-AES-128, data unit sequence number 0.
const V4_CT: &str = "\
27a7479befa1d476489f308cd4cfa6e2a96e4bbe3208ff25287dd3819616e89c\
c78cf7f5e543445f8333d8fa7f56000005279fa5d8b5e4ad40e736ddb4d35412\
328063fd2aab53e5ea1e0a9f332500a5df9487d07a5c92cc512c8866c7e860ce\
93fdf166a24912b422976146ae20ce846bb7dc9ba94a767aaef20c0d61ad0265\
5ea92dc4c4e41a8952c651d33174be51a10c421110e6d81588ede82103a252d8\
a750e8768defffed9122810aaeb99f9172af82b604dc4b8e51bcb08235a6f434\
1332e4ca60482a4ba1a03b3e65008fc5da76b70bf1690db4eae29c5f1badd03c\
5ccf2a55d705ddcd86d449511ceb7ec30bf12b1fa35b913f9f747a8afd1b130e\
94bff94effd01a91735ca1726acd0b197c4e5b03393697e126826fb6bbde8ecc\
1e08298516e2c9ed03ff3c1b7860f6de76d4cecd94c8119855ef5297ca67e9f3\
e7ff72b1e99785ca0a7e7720c5b36dc6d72cac9574c8cbbc2f801e23e56fd344\
b07f22154beba0f08ce8891e643ed995c94d9a69c9f1b5f499027a78572aeebd\
74d20cc39881c213ee770b1010e4bea718846977ae119f7a023ab58cca0ad752\
afe656bb3c17256a9f6e9bf19fdd5a38fc82bbe872c5539edb609ef4f79c203e\
bb140f2e583cb2ad15b4aa5b655016a8449277dbd477ef2c8d6c017db738b18d\
eb4a427d1923ce3ff262735779a418f20a282df920147beabe421ee5319d0568";
/// IEEE 1619-2007 vector 10: XTS-AES-256, data unit sequence number 0xff.
const V10_CT: &str = "\
1c3b3a102f770386e4836c99e370cf9bea00803f5e482357a4ae12d414a3e63b\
5d31e276f8fe4a8d66b317f9ac683f44680a86ac35adfc3345befecb4bb188fd\
5776926c49a3095eb108fd1098baec70aaa66999a72a82f27d848b21d4a741b0\
c5cd4d5fff9dac89aeba122961d03a757123e9870f8acf1000020887891429ca\
2a3e7a7d7df7b10355165c8b9a6d0a7de8b062c4500dc4cd120c0f7418dae3d0\
b5781c34803fa75421c790dfe1de1834f280d7667b327f6c8cd7557e12ac3a0f\
93ec05c52e0493ef31a12d3d9260f79a289d6a379bc70c50841473d1a8cc81ec\
583e9645e07b8d9670655ba5bbcfecc6dc3966380ad8fecb17b6ba02469a020a\
84e18e8f84252070c13e9f1f289be54fbc481457778f616015e1327a02b140f1\
505eb309326d68378f8374595c849d84f4c333ec4423885143cb47bd71c5edae\
9be69a2ffeceb1bec9de244fbe15992b11b77c040f12bd8f6a975a44a0f90c29\
a9abc3d4d893927284c58754cce294529f8614dcd2aba991925fedc4ae74ffac\
6e333b93eb4aff0479da9a410e4450e0dd7ae4c6e2910900575da401fc07059f\
645e8b7e9bfdef33943054ff84011493c27b3429eaedb4ed5376441a77ed4385\
1ad77f16f541dfd269d50d6a5f14fb0aab1cbb4c1550be97f7ab4066193c4caa\
773dad38014bd2092fa755c824bb5e54c4f36ffda9fcea70b9c6e693e148c151";
/// IEEE 1619-2007 vector 19: XTS-AES-128, data unit sequence number 0xa987654321 (> 32 bits).
const V19_CT: &str = "\
38b45812ef43a05bd957e545907e223b954ab4aaf088303ad910eadf14b42be6\
8b2461149d8c8ba85f992be970bc621f1b06573f63e867bf5875acafa04e42cc\
bd7bd3c2a0fb1fff791ec5ec36c66ae4ac1e806d81fbf709dbe29e471fad3854\
9c8e66f5345d7c1eb94f405d1ec785cc6f6a68f6254dd8339f9d84057e01a177\
41990482999516b5611a38f41bb6478e6f173f320805dd71b1932fc333cb9ee3\
9936beea9ad96fa10fb4112b901734ddad40bc1878995f8e11aee7d141a2f5d4\
8b7a4e1e7f0b2c04830e69a4fd1378411c2f287edf48c6c4e5c247a19680f7fe\
41cefbd49b582106e3616cbbe4dfb2344b2ae9519391f3e0fb4922254b1d6d2d\
19c6d4d537b3a26f3bcc51588b32f3eca0829b6a5ac72578fb814fb43cf80d64\
a233e3f997a3f02683342f2b33d25b492536b93becb2f5e1a8b82f5b88334272\
9e8ae09d16938841a21a97fb543eea3bbff59f13c1a18449e398701c1ad51648\
346cbc04c27bb2da3b93a1372ccae548fb53bee476f9e9c91773b1bb19828394\
d55d3e1a20ed69113a860b6829ffa847224604435070221b257e8dff783615d2\
cae4803a93aa4334ab482a0afac9c0aeda70b45a481df5dec5df8cc0f423c77a\
5fd46cd312021d4b438862419a791be03bb4d97c0e59578542531ba466a83baf\
92cefc151b5cc1611a167893819b63fb8a6b18e86de60290fa72b797b0ce59f3";

fn supporting(spec: &CipherSpec) -> Vec<Arc<dyn Engine>> {
    let all: Vec<_> = engines().into_iter().filter(|e| e.supports(spec)).collect();
    assert!(!all.is_empty(), "no engine supports {spec}");
    all
}

/// Encrypts one 512-byte sector with every engine that supports `spec`, checks the
/// ciphertext, then decrypts it back.
fn check_xts(key_hex: &str, sector: u64, expected_hex: &str) {
    let key = SecretKey::new(hex::decode(key_hex).unwrap());
    let spec = CipherSpec::parse("aes", "xts-plain64", key.len()).unwrap();
    let expected = hex::decode(expected_hex).unwrap();
    for engine in supporting(&spec) {
        let cipher = engine.new_cipher(&spec, &key, 512).unwrap();
        let mut buf = counting_512();
        cipher.crypt(Direction::Encrypt, sector, &mut buf).unwrap();
        assert_eq!(
            hex::encode(&buf),
            hex::encode(&expected),
            "{} encrypt",
            engine.name()
        );
        cipher.crypt(Direction::Decrypt, sector, &mut buf).unwrap();
        assert_eq!(buf, counting_512(), "{} decrypt", engine.name());
    }
}

#[test]
fn ieee1619_vector_4_xts_aes128() {
    check_xts(
        "2718281828459045235360287471352631415926535897932384626433832795",
        0,
        V4_CT,
    );
}

#[test]
fn ieee1619_vector_10_xts_aes256() {
    check_xts(
        "27182818284590452353602874713526624977572470936999595749669676273141592653589793238462643383279502884197169399375105820974944592",
        0xff,
        V10_CT,
    );
}

#[test]
fn ieee1619_vector_19_xts_aes128_sector_above_32_bits() {
    check_xts(
        "e0e1e2e3e4e5e6e7e8e9eaebecedeeefc0c1c2c3c4c5c6c7c8c9cacbcccdcecf",
        0xa9_8765_4321,
        V19_CT,
    );
}

#[test]
fn every_engine_the_cpu_can_run_takes_part_for_xts_256_and_512() {
    // The KATs above are only meaningful if the fast engines take part in them: vaes
    // wherever the CPU has what it needs (asked here independently of the engine).
    #[cfg(target_arch = "x86_64")]
    let vaes = std::arch::is_x86_feature_detected!("aes")
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("vaes")
        && std::arch::is_x86_feature_detected!("vpclmulqdq");
    #[cfg(not(target_arch = "x86_64"))]
    let vaes = false;
    let want: &[&str] = if vaes {
        &["vaes", "openssl", "rustcrypto"]
    } else {
        &["openssl", "rustcrypto"]
    };
    for bytes in [32, 64] {
        let spec = CipherSpec::parse("aes", "xts-plain64", bytes).unwrap();
        let names: Vec<_> = supporting(&spec).iter().map(|e| e.name()).collect();
        assert_eq!(names, want, "{bytes}-byte XTS");
    }
}

/// CBC answers were made with the system OpenSSL CLI, independent of both engines:
///   key K = 000102..1f (AES-256), plaintext = bytes 00..ff twice (512 bytes), sector 7;
///   plain64:   openssl enc -aes-256-cbc -K $K -iv 07000000000000000000000000000000 -nopad
///   plain64be: ... -iv 00000000000000000000000000000007
///   essiv:sha256: SALT = sha256(K bytes) (openssl dgst -sha256), IV = openssl enc
///     -aes-256-ecb -K $SALT -nopad of 07000000000000000000000000000000 = 4e1a0000..., then as above.
/// Each output was hashed with sha256sum; the first 32 bytes are kept for readable diffs.
fn check_cbc(mode: &str, key_hex: &str, sector: u64, head_hex: &str, sha256_hex: &str) {
    let key = SecretKey::new(hex::decode(key_hex).unwrap());
    let spec = CipherSpec::parse("aes", mode, key.len()).unwrap();
    for engine in supporting(&spec) {
        let cipher = engine.new_cipher(&spec, &key, 512).unwrap();
        let mut buf = counting_512();
        cipher.crypt(Direction::Encrypt, sector, &mut buf).unwrap();
        assert_eq!(
            hex::encode(&buf[..32]),
            head_hex,
            "{} {mode} head",
            engine.name()
        );
        assert_eq!(
            hex::encode(openssl::sha::sha256(&buf)),
            sha256_hex,
            "{} {mode} digest",
            engine.name()
        );
        cipher.crypt(Direction::Decrypt, sector, &mut buf).unwrap();
        assert_eq!(buf, counting_512(), "{} {mode} decrypt", engine.name());
    }
}

const K256: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";

#[test]
fn cbc_plain64_known_answer() {
    check_cbc(
        "cbc-plain64",
        K256,
        7,
        "c691906f5dd9debcaf0da734c7f9e568d16c8648e6ce5ed18ea00528db6227bd",
        "e88eb81604d249a330d4793be8328cbb00722c2d0fe50e1c352dd012a5059510",
    );
}

#[test]
fn cbc_plain_truncates_sector_to_32_bits() {
    // Same answer as plain64 at sector 7: plain keeps only the low 32 bits of 0x1_0000_0007.
    check_cbc(
        "cbc-plain",
        K256,
        0x1_0000_0007,
        "c691906f5dd9debcaf0da734c7f9e568d16c8648e6ce5ed18ea00528db6227bd",
        "e88eb81604d249a330d4793be8328cbb00722c2d0fe50e1c352dd012a5059510",
    );
}

#[test]
fn cbc_plain64be_known_answer() {
    check_cbc(
        "cbc-plain64be",
        K256,
        7,
        "6707727b78e59a3721269918fcf4848013098eb33fc0b72e05ef0ee78e19f651",
        "2a6f2e7b529a622618263544b1537e2ea0b0204282f910ff2b9ba43a5171e087",
    );
}

#[test]
fn cbc_essiv_sha256_known_answer() {
    check_cbc(
        "cbc-essiv:sha256",
        K256,
        7,
        "a3d6c0d9792a62b026eb9af1352222e34868d4d0b361c164242e4a95709fe5cb",
        "aa930da73b5f3929054e295a73b1a0e28be63c485dfa8b65fbeba6361d06b10b",
    );
}

#[test]
fn cbc_aes128_plain64_known_answer() {
    // openssl enc -aes-128-cbc -K 000102030405060708090a0b0c0d0e0f -iv 0700..00 -nopad | sha256sum
    let key = SecretKey::new(hex::decode("000102030405060708090a0b0c0d0e0f").unwrap());
    let spec = CipherSpec::parse("aes", "cbc-plain64", 16).unwrap();
    for engine in supporting(&spec) {
        let cipher = engine.new_cipher(&spec, &key, 512).unwrap();
        let mut buf = counting_512();
        cipher.crypt(Direction::Encrypt, 7, &mut buf).unwrap();
        assert_eq!(
            hex::encode(openssl::sha::sha256(&buf)),
            "30932aa03defa6497dbd88442088f826b52fbeb65abad09dfb342207e44c93af",
            "{}",
            engine.name()
        );
    }
}
