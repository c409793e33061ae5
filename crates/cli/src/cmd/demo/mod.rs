//! `cryptblk demo`: the main job on a built-in example. Generates a sample disk (data, zeroed
//! regions and holes), encrypts it into a new LUKS2 image, decrypts it back, and verifies the
//! round trip byte for byte, printing throughput and the header; then serves the encrypted
//! image and its plaintext twin to a vhost-user-blk client and compares their speed
//! (`serve.rs`). The twin is written densely, every byte allocated as in the encrypted image:
//! the sample's holes would read as zeros without touching the storage, and the comparison
//! would be sparse against dense, not plain against encrypted.
mod client;
mod serve;

use crate::args::{Cli, Command, DemoArgs};
use crate::convert::{self, first_difference, human_bytes};
use crate::options::crypto_pool;
use anyhow::{bail, Context, Result};
use clap::Parser;
use cryptblk_block::{BlockDevice, OpenOptions, RawFile};
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

const MIB: u64 = 1 << 20;

pub fn run(cli: &Cli, args: &DemoArgs) -> Result<()> {
    if args.size < 4 * MIB || !args.size.is_multiple_of(MIB) {
        bail!("--size must be a whole number of MiB, at least 4M");
    }
    let dir = &args.dir;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let key_file = dir.join("demo.key");
    let sample = dir.join("sample.raw");
    let encrypted = dir.join("sample.luks2");
    let decrypted = dir.join("roundtrip.raw");
    let plain = dir.join("plain.raw");
    for stale in [&sample, &encrypted, &decrypted, &plain] {
        let _ = std::fs::remove_file(stale);
    }

    write_demo_passphrase(&key_file)?;
    println!(
        "1. sample disk     {} ({}: random data, zeroed runs and holes)",
        sample.display(),
        human_bytes(args.size)
    );
    write_sample(&sample, args.size)?;

    let pool = crypto_pool(cli)?;
    let threads = pool.threads().to_string();
    let key = key_file.to_string_lossy().into_owned();
    let (src, enc, dec) = (
        sample.to_string_lossy().into_owned(),
        encrypted.to_string_lossy().into_owned(),
        decrypted.to_string_lossy().into_owned(),
    );
    // A demo should not make people wait for a 2-second, 1 GiB argon2id unlock twice.
    let encrypt = [
        "cryptblk",
        "--threads",
        &threads,
        "convert",
        "-f",
        "raw",
        "-O",
        "luks2",
        "--pbkdf",
        "argon2id",
        "--iter-time",
        "300",
        "--pbkdf-memory",
        "65536",
        "--key-file",
        &key,
        &src,
        &enc,
    ];
    let decrypt = [
        "cryptblk",
        "--threads",
        &threads,
        "convert",
        "-O",
        "raw",
        "--source-key-file",
        &key,
        &enc,
        &dec,
    ];

    println!(
        "2. encrypt         {} -> {} (LUKS2, aes-xts-plain64, 512-bit key, {} crypto threads)",
        src,
        enc,
        pool.threads()
    );
    let report = run_convert(&encrypt, &pool)?;
    println!(
        "   {} in {:.2} s, {:.0} MiB/s (including the key derivation)",
        human_bytes(report.bytes),
        report.seconds,
        rate(&report)
    );

    println!("3. decrypt         {} -> {}", enc, dec);
    let report = run_convert(&decrypt, &pool)?;
    println!(
        "   {} in {:.2} s, {:.0} MiB/s",
        human_bytes(report.bytes),
        report.seconds,
        rate(&report)
    );

    println!("4. verify          {} == {}", src, dec);
    let a = RawFile::open(
        &sample,
        OpenOptions {
            writable: false,
            lock: true,
        },
    )?;
    let b = RawFile::open(
        &decrypted,
        OpenOptions {
            writable: false,
            lock: true,
        },
    )?;
    if a.size() != b.size() {
        bail!(
            "verification failed: sizes differ ({} vs {})",
            a.size(),
            b.size()
        );
    }
    if let Some(offset) = first_difference(&a, &b, a.size())? {
        bail!("verification failed: the round trip differs at byte {offset}");
    }
    let plain_leak = first_difference(
        &a,
        &RawFile::open(
            &encrypted,
            OpenOptions {
                writable: false,
                lock: true,
            },
        )?,
        MIB,
    )?;
    if plain_leak.is_none() {
        bail!("verification failed: the encrypted image starts with the plaintext");
    }
    println!(
        "   identical ({}), and the LUKS2 image holds only ciphertext",
        human_bytes(a.size())
    );

    println!("5. header          cryptblk dump {}\n", enc);
    crate::cmd::dump::run(&crate::args::DumpArgs {
        json: false,
        image: encrypted.clone(),
    })?;
    println!();
    // The daemon takes the images' locks: this process lets go of them first.
    drop((a, b));
    write_dense_twin(&sample, &plain)?;
    serve::run(&serve::Images {
        dir,
        encrypted: &encrypted,
        plain: &plain,
        key_file: &key_file,
        threads: pool.threads(),
    })?;
    println!(
        "\nDemo OK. Files are in {}/ (passphrase in {}).",
        dir.display(),
        key_file.display()
    );
    Ok(())
}

fn run_convert(
    argv: &[&str],
    pool: &std::sync::Arc<cryptblk_crypto::CryptoPool>,
) -> Result<convert::ConvertReport> {
    let cli = Cli::try_parse_from(argv).context("building the demo's convert command")?;
    let Command::Convert(ref args) = cli.command else {
        unreachable!("argv names the convert command")
    };
    convert::convert(&cli, args, pool)
}

fn rate(r: &convert::ConvertReport) -> f64 {
    r.bytes as f64 / r.seconds.max(1e-9) / MIB as f64
}

fn write_demo_passphrase(path: &Path) -> Result<()> {
    let mut random = [0u8; 12];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut random))?;
    let passphrase: String = random.iter().map(|b| format!("{b:02x}")).collect();
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    f.write_all(format!("demo-{passphrase}").as_bytes())?;
    Ok(())
}

/// A copy of `src` with every byte written, zeros and holes included, so that no read of it
/// is answered without the storage.
fn write_dense_twin(src: &Path, dst: &Path) -> Result<()> {
    let from = std::fs::File::open(src).with_context(|| format!("opening {}", src.display()))?;
    let to = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(dst)
        .with_context(|| format!("creating {}", dst.display()))?;
    let size = from.metadata()?.len();
    let mut buf = vec![0u8; MIB as usize];
    let mut offset = 0;
    while offset < size {
        let n = (size - offset).min(MIB) as usize;
        from.read_exact_at(&mut buf[..n], offset)?;
        to.write_all_at(&buf[..n], offset)?;
        offset += n as u64;
    }
    to.sync_all()
        .with_context(|| format!("writing {}", dst.display()))
}

/// Every 4 MiB: 2 MiB of pseudo-random data, 1 MiB of explicit zeros, 1 MiB left as a hole.
fn write_sample(path: &Path, size: u64) -> Result<()> {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    file.set_len(size)?;
    let mut buf = vec![0u8; MIB as usize];
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for mib in 0..size / MIB {
        match mib % 4 {
            0 | 1 => {
                for word in buf.chunks_exact_mut(8) {
                    // xorshift64*: fast, deterministic filler that does not compress.
                    state ^= state >> 12;
                    state ^= state << 25;
                    state ^= state >> 27;
                    word.copy_from_slice(&state.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
                }
                file.write_all_at(&buf, mib * MIB)?;
            }
            2 => file.write_all_at(&vec![0u8; MIB as usize], mib * MIB)?,
            _ => {}
        }
    }
    file.sync_all()?;
    Ok(())
}
