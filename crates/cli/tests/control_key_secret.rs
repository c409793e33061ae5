//! Passphrases sent inline, encrypted with the daemon's master key, as libvirt sends secrets to
//! QEMU: `serve --master-key-file` (32 random bytes), and `key-secret`/`key-secret-iv` made by
//! the real `openssl enc -aes-256-cbc -K .. -iv .. -a`. The disk unlocks and serves the right
//! data, keyslots change, bad secrets are refused clearly with nothing changed, and the
//! passphrase never shows in the daemon's trace log, its argv or the request ctl sends.
mod common;

use common::secret::*;
use common::*;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;

/// `serve --control --nbd` (and `serve`'s options), its log at trace level.
fn serve(t: &TestDir) -> Serve {
    t.serve().control().nbd().log_level("trace")
}

/// A LUKS2 image "vol.luks" and its key file (only to format the image and check it
/// afterwards, as cryptsetup would).
fn image(t: &TestDir) -> (Image, String) {
    let key = t.key("setup.key");
    let pass = key.passphrase.clone();
    (t.luks2("vol.luks", "8M", &key), pass)
}

fn keyslots(img: &Image) -> usize {
    img.dump()["keyslots"].as_array().expect("keyslots").len()
}

#[test]
fn a_secret_under_the_master_key_opens_a_disk_and_changes_its_keyslots() {
    let t = TestDir::new();
    let (img, pass) = image(&t);
    let (master_path, master) = master_key_file(t.root(), "master.key");
    let daemon = serve(&t)
        .args(&["--master-key-file", s(&master_path)])
        .start();
    let secret = seal(&master, &pass);
    let add = |given: &Secret| {
        daemon.ctl(&argv!(
            "disk-add vol --image {} --nbd-export --key-secret {} --key-secret-iv {}",
            img,
            &given.data,
            &given.iv
        ))
    };

    // Encrypted under another master key: refused by name, nothing attached.
    let foreign = foreign_secret(&master, &pass);
    let out = add(&foreign);
    out.expect_code(code::USAGE);
    out.error_line(&["key-secret did not decrypt with the daemon's master key"]);
    // The right ciphertext with a wrong IV: the first block decrypts to other bytes, which
    // open no keyslot (CBC cannot tell it otherwise).
    let wrong_iv = Secret {
        iv: base64(&random_bytes(16)),
        ..seal_with_iv(&master, &pass, secret.iv_bytes.clone())
    };
    let out = add(&wrong_iv);
    out.expect_code(code::WRONG_PASSPHRASE);
    out.error_line(&["unlocking with key-secret", "is key-secret-iv right?"]);
    let bad_iv = Secret {
        iv: base64(&random_bytes(8)),
        ..seal(&master, &pass)
    };
    add(&bad_iv).error_line(&["key-secret-iv holds 8 bytes, not 16"]);
    let list = daemon.ctl_ok(&["disk-list"]);
    assert_eq!(list["disks"].as_array().map(Vec::len), Some(0), "{list}");

    // The right secret: attached; data written over NBD reads back.
    add(&secret).ok();
    daemon.qemu_io("vol", &["write -P 0x5a 64k 128k"]);

    // key-add: a secret that does not decrypt changes nothing and the disk keeps serving.
    let new = passphrase("secret-new");
    let new_secret = seal(&master, &new);
    let key_add = |old: &Secret| {
        daemon.ctl(&argv!("key-add vol --key-secret {} --key-secret-iv {} --new-key-secret {} --new-key-secret-iv {} --pbkdf pbkdf2 --iter-time 1", &old.data, &old.iv, &new_secret.data, &new_secret.iv))
    };
    key_add(&foreign).error_line(&["key-secret did not decrypt"]);
    let out = key_add(&wrong_iv);
    out.expect_code(code::WRONG_PASSPHRASE);
    out.error_line(&["unlocking with key-secret", "key-secret-iv"]);
    let read = ["read -P 0x5a 64k 128k"];
    daemon.qemu_io("vol", &read);
    // Both passphrases as secrets: a new keyslot.
    key_add(&secret).ok();
    daemon.ctl_ok(&["disk-remove", "vol"]);
    assert_eq!(keyslots(&img), 2, "exactly one keyslot was added");
    let new_key = t.key_with("check.key", &new);
    assert!(
        img.opens_with(&new_key),
        "the new keyslot does not open the image"
    );
    // What the secret-unlocked disk wrote is the right plaintext under the LUKS key.
    let plain = img.decrypt(&t.path("plain.raw"));
    assert!(plain[64 << 10..192 << 10].iter().all(|&b| b == 0x5a));

    // The new passphrase, as a secret, opens the disk; key-remove by secret removes it.
    add(&new_secret).ok();
    daemon.qemu_io("vol", &read);
    daemon
        .ctl(&argv!(
            "key-remove vol --key-secret {} --key-secret-iv {}",
            &new_secret.data,
            &new_secret.iv
        ))
        .ok();
    daemon.ctl_ok(&["disk-remove", "vol"]);
    assert!(!img.opens_with(&new_key), "key-remove did not remove it");
    assert!(img.opens_with(img.key()));

    // Every refusal above was logged (at the most verbose level the daemon has), without it.
    assert!(daemon.log().contains("refused: key-secret did not decrypt"));
    daemon.assert_never_shows(&pass);
    daemon.assert_never_shows(&new);
    drop(daemon);

    // A config file may name the passphrase as a secret too: it then holds no passphrase in
    // clear, only what the master key opens.
    let config = t.path("disks.toml");
    std::fs::write(
        &config,
        format!(
            "[[disk]]\nname = \"vol\"\nimage = \"{}\"\nkey-secret = \"{}\"\nkey-secret-iv = \"{}\"\n",
            s(&img),
            secret.data,
            secret.iv
        ),
    )
    .unwrap();
    let daemon = serve(&t).config(&config);
    let daemon = daemon.args(&["--master-key-file", s(&master_path)]).start();
    daemon.qemu_io("vol", &read);
    daemon.assert_never_shows(&pass);
}

#[test]
fn without_a_usable_master_key_secrets_are_refused() {
    let t = TestDir::new();
    let (img, pass) = image(&t);
    let (_, master) = master_key_file(t.root(), "master.key");
    let secret = seal(&master, &pass);

    // Started without one: the request says how to fix it; nothing attached.
    let daemon = serve(&t).start();
    let out = daemon.ctl(&argv!(
        "disk-add vol --image {} --key-secret {} --key-secret-iv {}",
        img,
        &secret.data,
        &secret.iv
    ));
    out.expect_code(code::USAGE);
    out.error_line(&["the daemon has no master key: start serve with --master-key-file"]);
    let list = daemon.ctl_ok(&["disk-list"]);
    assert_eq!(list["disks"].as_array().map(Vec::len), Some(0), "{list}");
    daemon.assert_never_shows(&pass);
    drop(daemon);

    // A master key file that is not 32 bytes, or is a directory: serve refuses to start.
    let short = t.path("short.key");
    std::fs::write(&short, &master[..31]).unwrap();
    let hex_text = t.path("hex.key");
    std::fs::write(&hex_text, hex::encode(&master)).unwrap();
    for (path, said) in [
        (&short, "holds 31 bytes, not exactly 32"),
        (&hex_text, "holds more than 32 bytes"),
        (&t.root().to_path_buf(), "is a directory"),
    ] {
        let control = t.path("refused.sock");
        let out = cryptblk(argv!(
            "serve --control {} --master-key-file {}",
            control,
            path
        ));
        out.expect_code(code::USAGE);
        out.error_line(&["--master-key-file", said]);
        assert!(!control.exists(), "a refused start left its socket");
    }

    // One its group may read: used, with a warning like a key file's.
    let (open_path, _) = master_key_file(t.root(), "open.key");
    std::fs::set_permissions(
        &open_path,
        std::os::unix::fs::PermissionsExt::from_mode(0o640),
    )
    .unwrap();
    let daemon = serve(&t)
        .args(&["--master-key-file", s(&open_path)])
        .start();
    let log = daemon.log();
    assert!(
        log.contains("master key file") && log.contains("is readable by its group"),
        "{log}"
    );
}

#[test]
fn ctl_sends_the_ciphertext_never_the_passphrase() {
    // A stand-in daemon that records the request line ctl sends and answers it.
    let t = TestDir::new();
    let sock = t.path("recorder.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    let recorder = std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let mut line = String::new();
        BufReader::new(&stream).read_line(&mut line).unwrap();
        let request: serde_json::Value = serde_json::from_str(&line).unwrap();
        let reply = serde_json::json!({"jsonrpc": "2.0", "id": request["id"],
                                       "result": {"name": "vol", "keyslot": 1}});
        (&stream)
            .write_all(format!("{reply}\n").as_bytes())
            .unwrap();
        line
    });
    let (_, master) = master_key_file(t.root(), "master.key");
    let old = passphrase("secret-wire-old");
    let new = passphrase("secret-wire-new");
    let (old_secret, new_secret) = (seal(&master, &old), seal(&master, &new));
    ctl(
        &sock,
        &argv!("key-add vol --key-secret {} --key-secret-iv {} --new-key-secret {} --new-key-secret-iv {}", &old_secret.data, &old_secret.iv, &new_secret.data, &new_secret.iv),
    )
    .ok();
    let sent = recorder.join().unwrap();
    let request: serde_json::Value = serde_json::from_str(&sent).unwrap();
    assert_eq!(request["params"]["key-secret"], old_secret.data.as_str());
    assert_eq!(
        request["params"]["new-key-secret-iv"],
        new_secret.iv.as_str()
    );
    for plain in [&old, &new] {
        assert!(!sent.contains(plain.as_str()), "sent in clear: {sent}");
        let b64 = base64(plain.as_bytes());
        assert!(!sent.contains(&b64), "sent as plain base64: {sent}");
    }
}

#[test]
fn reencrypt_start_and_migrate_incoming_take_secrets_too() {
    let t = TestDir::new();
    let (img, pass) = image(&t);
    let (master_path, master) = master_key_file(t.root(), "master.key");
    let daemon = serve(&t)
        .args(&["--master-key-file", s(&master_path)])
        .start();
    let secret = seal(&master, &pass);
    let foreign = foreign_secret(&master, &pass);
    daemon
        .ctl(&argv!(
            "disk-add vol --image {} --nbd-export --key-secret {} --key-secret-iv {}",
            img,
            &secret.data,
            &secret.iv
        ))
        .ok();
    daemon.qemu_io("vol", &["write -P 0xc3 1M 2M"]);

    // migrate-incoming: a secret that does not decrypt fails the request at once, before
    // anything listens or is created.
    let incoming = t.path("in.luks");
    let listen = t.path("mig.sock");
    let out = daemon.ctl(&argv!(
        "migrate-incoming in --image {} --listen unix:{} --key-secret {} --key-secret-iv {}",
        incoming,
        listen,
        &foreign.data,
        &foreign.iv
    ));
    out.error_line(&["key-secret did not decrypt"]);
    assert!(!listen.exists() && !incoming.exists());

    // reencrypt-start: refused with a foreign secret; with the right one the volume key is
    // replaced while the disk serves, and the data stays.
    let start = |given: &Secret| {
        daemon.ctl(&argv!(
            "reencrypt-start vol --key-secret {} --key-secret-iv {} --pbkdf pbkdf2 --iter-time 1",
            &given.data,
            &given.iv
        ))
    };
    start(&foreign).error_line(&["key-secret did not decrypt"]);
    assert_eq!(daemon.ctl_ok(&["reencrypt-status", "vol"])["phase"], "idle");
    let before = img.dump();
    start(&secret).ok();
    daemon.wait_reencrypt("vol", "the end", |st| st["phase"] == "finished");
    daemon.qemu_io("vol", &["read -P 0xc3 1M 2M"]);
    daemon.ctl_ok(&["disk-remove", "vol"]);
    assert_ne!(
        img.dump()["digests"],
        before["digests"],
        "the volume key was not replaced"
    );
    assert!(img.opens_with(img.key()));
    let plain = img.decrypt(&t.path("plain.raw"));
    assert!(plain[1 << 20..3 << 20].iter().all(|&b| b == 0xc3));
    daemon.assert_never_shows(&pass);
}
