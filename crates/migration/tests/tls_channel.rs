//! The TLS channel halves carry data both ways at once.
mod common;

use cryptblk_migration::channel::{connect, ListenOptions, MigrationListener};
use std::io::{Read, Write};
use std::sync::Arc;

#[test]
fn tls_channel_carries_data_both_ways() {
    let creds = tempfile::tempdir().unwrap();
    common::make_credentials(creds.path(), "channel CA");
    let server = cryptblk_tls::server_config(creds.path()).unwrap();
    let client = Arc::new(cryptblk_tls::client_config(creds.path()).unwrap());
    let listener = MigrationListener::bind(
        &"tcp:127.0.0.1:0".parse().unwrap(),
        ListenOptions::tls(Some(Arc::new(server))),
    )
    .unwrap();
    let addr = listener.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let mut ch = listener.accept().unwrap().establish().unwrap();
        let mut buf = vec![0u8; 5];
        ch.reader.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"hello");
        let big = vec![0xabu8; 4 << 20];
        ch.writer.write_all(&big).unwrap();
    });
    let mut ch = connect(
        &addr,
        Some(&client),
        None,
        std::time::Duration::from_secs(10),
    )
    .unwrap();
    ch.writer.write_all(b"hello").unwrap();
    let mut big = vec![0u8; 4 << 20];
    ch.reader.read_exact(&mut big).unwrap();
    assert!(big.iter().all(|&b| b == 0xab));
    t.join().unwrap();
}
