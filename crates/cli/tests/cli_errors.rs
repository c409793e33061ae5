//! Bad input: one clear `cryptblk: ` line, the documented exit status, and data left intact.
//! This file: usage errors (exit 1), a missing image (exit 5), an image in use (exit 6), and
//! `--help` documenting the exit statuses. Damaged, unsupported and hostile images are in
//! `cli_errors_image.rs`; passphrases, key files and key material in `cli_errors_keys.rs`.
mod common;

use common::cli_errors::*;
use common::*;

#[test]
fn usage_errors_exit_1() {
    let t = TestDir::new();
    let (key, img) = (t.key("key"), t.path("u.img"));
    let cases = [
        argv!("no-such-command"),
        argv!("convert"),
        argv!("--threads 0 bench"),
        argv!("--threads 100000 convert -O raw {} {}", key, img),
        argv!("format --key-file {}", key),
        argv!("format -q --sector-size 1000 --key-file {} {} 4M", key, img),
        argv!(
            "format -q --type luks1 --sector-size 4096 --key-file {} {} 4M",
            key,
            img
        ),
        argv!(
            "format -q --type luks1 --pbkdf argon2id --key-file {} {} 4M",
            key,
            img
        ),
        argv!("format -q --key-file {} {} 12Q", key, img),
        argv!("format -q --key-size 511 --key-file {} {} 4M", key, img),
        argv!("convert -O luks --key-file {} {} {}", key, key, img),
        argv!("convert -O qcow2 {} {}", key, img),
        argv!("dump --bogus {}", img),
        argv!("--threads many bench"),
        argv!("--crypto-engine qat bench"),
        argv!("--crypto-engine vaes,qat bench"),
    ];
    for args in cases {
        let out = cryptblk(&args);
        out.expect_code(code::USAGE);
        let what = &out.what;
        assert!(
            !out.stderr.trim().is_empty(),
            "`{what}`: usage error without a message"
        );
        assert!(!img.exists(), "`{what}` created the image");
    }
}

#[test]
fn format_existing_file_with_size_refused() {
    let t = TestDir::new();
    let (key, img) = (t.key("key"), t.path("data.img"));
    let content: Vec<u8> = (0..(2 * MIB as usize))
        .map(|i| (i * 7 % 251) as u8)
        .collect();
    std::fs::write(&img, &content).unwrap();
    cryptblk_cheap(argv!("format -q --key-file {} {} 4M", key, img))
        .expect_code(code::USAGE)
        .error_line(&["exists"]);
    assert!(
        read(&img) == content,
        "a refused format changed the existing file"
    );
}

#[test]
fn missing_file_exit_5_names_path() {
    let t = TestDir::new();
    let (key, missing, out) = (
        t.key("key"),
        t.path("no-such-image.luks"),
        t.path("out.raw"),
    );
    cryptblk(argv!("dump {}", missing))
        .expect_code(code::IO)
        .error_line(&[s(&missing)]);
    cryptblk(argv!(
        "convert -O raw --source-key-file {} {} {}",
        key,
        missing,
        out
    ))
    .expect_code(code::IO)
    .error_line(&[s(&missing)]);
    assert!(!out.exists());
    cryptblk(argv!("key remove --key-file {} {}", key, missing))
        .expect_code(code::IO)
        .error_line(&[s(&missing)]);
}

/// An image locked by another process (e.g. a daemon serving it) is refused with exit 6, and
/// the header is not touched.
#[test]
fn locked_image_exit_6() {
    let f = luks2_fixture();
    let new = f.t.key("new");
    let holder = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&f.img)
        .unwrap();
    holder.try_lock().expect("taking the test's exclusive lock");
    let before = read(&f.img);
    let add = || {
        cryptblk_cheap(argv!(
            "key add --key-file {} --new-key-file {} {}",
            f.key,
            new,
            f.img
        ))
    };
    add().expect_code(code::IN_USE).error_line(&["in use"]);
    let src = f.path("src.raw");
    std::fs::write(&src, vec![1u8; 4096]).unwrap();
    cryptblk(argv!(
        "convert -n -O luks --key-file {} {} {}",
        f.key,
        src,
        f.img
    ))
    .expect_code(code::IN_USE);
    f.assert_unchanged(&before, "a locked image was modified");
    drop(holder);
    // Another test of this binary may have forked a child while `holder` was open; the
    // child holds a copy of the lock until it execs (O_CLOEXEC), so allow a moment.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let out = add();
        if out.code != code::IN_USE || std::time::Instant::now() > deadline {
            out.ok();
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[test]
fn help_documents_exit_codes_and_convert_memory_bound() {
    for flag in ["-h", "--help"] {
        let out = cryptblk([flag]);
        assert_eq!(out.code, 0, "{}", out.stderr);
        for needle in [
            "Exit status:",
            "2  wrong passphrase",
            "4  damaged",
            "7  resource limit",
        ] {
            let stdout = &out.stdout;
            assert!(
                stdout.contains(needle),
                "`cryptblk {flag}` lacks {needle:?}:\n{stdout}"
            );
        }
    }
    let out = cryptblk(["convert", "--help"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let stdout = &out.stdout;
    assert!(
        stdout.contains("Memory:"),
        "convert --help states no memory bound:\n{stdout}"
    );
    assert!(stdout.contains("-t <CACHE>"), "{stdout}");
}
