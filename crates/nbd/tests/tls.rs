//! TLS with certificates made by the openssl CLI, checked with QEMU's TLS client.
mod common;

use common::{export, pattern, raw_file, run, run_failing, TestServer};
use cryptblk_nbd::protocol::*;
use cryptblk_nbd::{ExportRegistry, TlsCreds};
use std::path::Path;

use cryptblk_testutil::x509;

fn make_credentials(dir: &Path) {
    x509::make_credentials(dir, "cryptblk test CA");
}

#[test]
fn qemu_connects_over_tls_and_plain_clients_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let registry = ExportRegistry::new();
    let size = 8u64 << 20;
    let device = raw_file(&dir.path().join("disk.raw"), size, size as usize);
    registry.add(export("secure", device)).unwrap();
    let (server, creds_dir) = TestServer::tls(dir.path(), registry);
    let port = server.port().to_owned();
    let [object, image] = common::qemu_tls_opts(&port, "secure", &creds_dir);
    let info = run(
        "qemu-img",
        &["info", "--object", &object, "--image-opts", &image],
    );
    assert!(info.contains("virtual size: 8 MiB"), "{info}");

    run(
        "qemu-io",
        &[
            "--object",
            &object,
            "--image-opts",
            &image,
            "-c",
            "write -P 0x3c 64k 64k",
            "-c",
            "read -P 0x3c 64k 64k",
        ],
    );
    let copy = dir.path().join("copy.raw");
    run(
        "qemu-img",
        &[
            "convert",
            "--object",
            &object,
            "--image-opts",
            &image,
            "-O",
            "raw",
            copy.to_str().unwrap(),
        ],
    );
    let mut expected = pattern(size as usize, size);
    expected[64 << 10..128 << 10].fill(0x3c);
    assert!(std::fs::read(&copy).unwrap() == expected);

    // Without TLS: qemu gives up, and raw options before STARTTLS get ERR_TLS_REQD.
    let plain = format!("nbd://127.0.0.1:{port}/secure");
    let error = run_failing("qemu-img", &["info", &plain]);
    assert!(error.to_lowercase().contains("tls"), "{error}");

    let mut stream = std::net::TcpStream::connect(&server.address).unwrap();
    use std::io::{Read, Write};
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting).unwrap();
    stream
        .write_all(&CLIENT_FLAG_FIXED_NEWSTYLE.to_be_bytes())
        .unwrap();
    for option in [OPT_LIST, OPT_STRUCTURED_REPLY, OPT_GO] {
        let mut message = Vec::new();
        message.extend_from_slice(&IHAVEOPT.to_be_bytes());
        message.extend_from_slice(&option.to_be_bytes());
        message.extend_from_slice(&0u32.to_be_bytes());
        stream.write_all(&message).unwrap();
        let mut reply = [0u8; 20];
        stream.read_exact(&mut reply).unwrap();
        assert_eq!(
            u32::from_be_bytes(reply[12..16].try_into().unwrap()),
            REP_ERR_TLS_REQD,
            "option {option}"
        );
    }
    // EXPORT_NAME cannot be refused with a reply: the server hangs up.
    let mut message = Vec::new();
    message.extend_from_slice(&IHAVEOPT.to_be_bytes());
    message.extend_from_slice(&OPT_EXPORT_NAME.to_be_bytes());
    message.extend_from_slice(&6u32.to_be_bytes());
    message.extend_from_slice(b"secure");
    stream.write_all(&message).unwrap();
    let mut byte = [0u8; 1];
    assert!(matches!(stream.read(&mut byte), Ok(0) | Err(_)));
}

#[test]
fn loading_credentials_names_the_missing_or_bad_file() {
    let dir = tempfile::tempdir().unwrap();
    let error = TlsCreds::load(dir.path()).unwrap_err().to_string();
    assert!(
        error.contains("ca-cert.pem") && error.contains("missing"),
        "{error}"
    );

    make_credentials(dir.path());
    TlsCreds::load(dir.path()).unwrap();

    std::fs::write(dir.path().join("server-key.pem"), "not a key\n").unwrap();
    let error = TlsCreds::load(dir.path()).unwrap_err().to_string();
    assert!(error.contains("server-key.pem"), "{error}");

    std::fs::remove_file(dir.path().join("server-cert.pem")).unwrap();
    let error = TlsCreds::load(dir.path()).unwrap_err().to_string();
    assert!(error.contains("server-cert.pem"), "{error}");
}
