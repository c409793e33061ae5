//! Who may reach an export: over TLS only clients with a certificate the CA signed, and with
//! an allow-list only the names on it (QEMU's qemu-io as the client, certificates made by the
//! openssl CLI); plain TCP only on loopback unless asked for; a flood of connections beyond
//! the limits is turned away while a client already connected keeps working.
mod common;

use common::{export, pattern, raw_file, run_failing, TestServer};
use cryptblk_nbd::protocol::*;
use cryptblk_nbd::{
    AllowList, ConnectionLimits, Error, ExportRegistry, NbdAddress, NbdServer, TlsCreds,
};
use cryptblk_testutil::nbd::RawClient;
use cryptblk_testutil::x509::{make_client_credentials, make_credentials};
use std::path::Path;

const SIZE: u64 = 4 << 20;

/// Runs qemu-io against `export` on `port` as the client whose credentials are in `client`,
/// with the commands given; `Ok(stdout)` or `Err(stderr)`.
fn qemu_io(port: &str, export: &str, client: &Path, commands: &[&str]) -> Result<String, String> {
    let [object, image] = common::qemu_tls_opts(port, export, client);
    let mut args = vec!["--object", &object, "--image-opts", &image];
    for c in commands {
        args.extend(["-c", c]);
    }
    let out = std::process::Command::new(common::tool("qemu-io"))
        .args(&args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    // qemu-io reports a failed command on stdout and may still exit 0; a refused open exits 1.
    if out.status.success() && !stdout.contains("error") && !stdout.contains("failed") {
        Ok(stdout)
    } else {
        Err(format!("{stderr}{stdout}"))
    }
}

#[test]
fn only_clients_with_a_listed_certificate_read_or_write() {
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    let stranger_ca = dir.path().join("stranger-ca");
    std::fs::create_dir(&pki).unwrap();
    std::fs::create_dir(&stranger_ca).unwrap();
    make_credentials(&pki, "cryptblk test CA");
    make_credentials(&stranger_ca, "another CA");

    // The clients: the CA only (no certificate), a certificate from another CA, a certificate
    // from our CA whose name is not listed, and the two listed ones (by CN, by DNS name).
    let ca_only = dir.path().join("ca-only");
    std::fs::create_dir(&ca_only).unwrap();
    std::fs::copy(pki.join("ca-cert.pem"), ca_only.join("ca-cert.pem")).unwrap();
    let stranger = dir.path().join("stranger");
    make_client_credentials(&stranger_ca, &stranger, "vm1-backup", None);
    std::fs::copy(pki.join("ca-cert.pem"), stranger.join("ca-cert.pem")).unwrap();
    let intruder = dir.path().join("intruder");
    make_client_credentials(&pki, &intruder, "vm2-backup", None);
    let by_cn = dir.path().join("by-cn");
    make_client_credentials(&pki, &by_cn, "vm1-backup", None);
    let by_dns = dir.path().join("by-dns");
    make_client_credentials(&pki, &by_dns, "some host", Some("backup.example.org"));

    let registry = ExportRegistry::new();
    let disk = dir.path().join("disk.raw");
    registry
        .add(export("secure", raw_file(&disk, SIZE, SIZE as usize)))
        .unwrap();
    // A second export whose own list names only the intruder's certificate.
    let mut other = export(
        "other",
        raw_file(&dir.path().join("other.raw"), SIZE, SIZE as usize),
    );
    other.tls_authz = Some(AllowList::parse("vm2-backup").unwrap());
    registry.add(other).unwrap();
    let creds = TlsCreds::load(&pki)
        .unwrap()
        .with_authz(AllowList::parse("vm1-backup, backup.example.org").unwrap());
    let server = TestServer::start(
        NbdAddress::Tcp("127.0.0.1:0".into()),
        registry,
        Some(creds),
        |server| server,
    );
    let port = server.address.rsplit_once(':').unwrap().1.to_owned();

    for (who, client) in [
        ("no certificate", &ca_only),
        ("another CA's certificate", &stranger),
        ("an unlisted name", &intruder),
    ] {
        for command in ["write -P 0x5a 0 64k", "read -P 0 0 64k"] {
            let refused = qemu_io(&port, "secure", client, &[command]);
            assert!(refused.is_err(), "{who}: {command} succeeded: {refused:?}");
        }
    }
    assert!(
        std::fs::read(&disk).unwrap() == pattern(SIZE as usize, SIZE),
        "a refused client changed the disk"
    );

    // The listed names, by CN and by DNS subjectAltName, read and write.
    for (client, byte) in [(&by_cn, "0x11"), (&by_dns, "0x22")] {
        let write = format!("write -P {byte} 64k 64k");
        let read = format!("read -P {byte} 64k 64k");
        qemu_io(&port, "secure", client, &[&write, &read]).unwrap();
    }
    let mut expected = pattern(SIZE as usize, SIZE);
    expected[64 << 10..128 << 10].fill(0x22);
    assert!(std::fs::read(&disk).unwrap() == expected);

    // An export's own list replaces the server's: the intruder's name is on "other"'s.
    qemu_io(&port, "other", &intruder, &["write -P 0x33 0 4k"]).unwrap();
    assert!(qemu_io(&port, "other", &by_cn, &["read 0 4k"]).is_err());
    assert!(qemu_io(&port, "secure", &intruder, &["read 0 4k"]).is_err());

    // The existing credentials directory (CN "cryptblk test client", not listed) is refused
    // as well, with QEMU's own message.
    let [object, image] = common::qemu_tls_opts(&port, "secure", &pki);
    run_failing(
        "qemu-img",
        &["info", "--object", &object, "--image-opts", &image],
    );
}

#[test]
fn plain_tcp_is_refused_off_loopback_unless_asked_for() {
    let dir = tempfile::tempdir().unwrap();
    let registry = ExportRegistry::new();
    registry
        .add(export("d", raw_file(&dir.path().join("d.raw"), SIZE, 0)))
        .unwrap();
    for address in ["tcp:0.0.0.0:0", "tcp:[::]:0"] {
        let Err(error) = NbdServer::bind(&address.parse().unwrap(), registry.clone(), None) else {
            panic!("plain NBD bound on {address}");
        };
        assert!(matches!(error, Error::PlainTcp { .. }), "{error}");
        assert!(error.to_string().contains("--nbd-insecure"), "{error}");
    }
    // Loopback and Unix sockets stay allowed; on purpose, the wildcard too.
    NbdServer::bind(&"tcp:127.0.0.1:0".parse().unwrap(), registry.clone(), None).unwrap();
    let sock = NbdAddress::Unix(dir.path().join("nbd.sock"));
    NbdServer::bind(&sock, registry.clone(), None).unwrap();
    let server = NbdServer::bind_plain_tcp(&"tcp:0.0.0.0:0".parse().unwrap(), registry).unwrap();
    assert!(
        server.local_addr().starts_with("0.0.0.0:"),
        "{}",
        server.local_addr()
    );
}

#[test]
fn a_connection_flood_is_turned_away_while_a_connected_client_keeps_working() {
    let dir = tempfile::tempdir().unwrap();
    let registry = ExportRegistry::new();
    registry
        .add(export(
            "d",
            raw_file(&dir.path().join("d.raw"), SIZE, SIZE as usize),
        ))
        .unwrap();
    let server = TestServer::unix_with(dir.path(), registry, |s| {
        s.with_connection_limits(ConnectionLimits {
            total: 4,
            per_peer: 4,
        })
    });
    let socket = server.socket_path().to_path_buf();
    let (mut client, _, _) = RawClient::open(&socket, "d", false);
    // Three more fill the limit (they sit in the handshake); every one after is closed at once.
    let idle: Vec<RawClient> = (0..3).map(|_| RawClient::connect(&socket)).collect();
    for _ in 0..20 {
        let mut refused =
            std::os::unix::net::UnixStream::connect(&socket).expect("the kernel accepts it");
        refused
            .set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        let mut greeting = [0u8; 18];
        let read = std::io::Read::read(&mut refused, &mut greeting);
        assert!(
            matches!(read, Ok(0) | Err(_)),
            "a connection over the limit got {read:?}"
        );
    }
    // The connected client reads and writes as before.
    client.send_request(CMD_WRITE, 0, 1, 0, 4096);
    std::io::Write::write_all(&mut client.stream, &[0x77; 4096]).unwrap();
    assert_eq!(client.read_simple_reply(0).0, 0);
    client.send_request(CMD_READ, 0, 2, 0, 4096);
    let (error, cookie, data) = client.read_simple_reply(4096);
    assert_eq!((error, cookie), (0, 2));
    assert!(data.iter().all(|&b| b == 0x77));
    // Slots come back when connections go.
    drop(idle);
    std::thread::sleep(std::time::Duration::from_millis(200));
    let (_again, size, _) = RawClient::open(&socket, "d", false);
    assert_eq!(size, SIZE);
}
