//! Turning command-line option groups into the library's option types.
use crate::args::{Cli, LuksFormatArgs, LuksType, PbkdfArgs, PbkdfChoice, ReencryptArgs};
use crate::exit::UsageError;
use anyhow::Result;
use cryptblk_crypto::{CipherSpec, CryptoPool};
use cryptblk_luks::kdf::Argon2Variant;
use cryptblk_luks::{FormatOptions, HashAlg, LuksVersion, PbkdfKind, PbkdfOptions, UnlockOptions};
use cryptblk_volume::{NewLayout, PrepareError};
use std::sync::Arc;

pub fn pbkdf_options(
    args: &PbkdfArgs,
    hash: HashAlg,
    version: LuksVersion,
) -> Result<PbkdfOptions> {
    let mut opts = PbkdfOptions {
        hash,
        ..PbkdfOptions::default()
    };
    opts.kind = match (version, args.pbkdf) {
        (LuksVersion::V1, None | Some(PbkdfChoice::Pbkdf2)) => PbkdfKind::Pbkdf2,
        (LuksVersion::V1, Some(other)) => {
            return Err(UsageError(
                format!("LUKS1 keyslots only support pbkdf2, not {other:?}").to_lowercase(),
            )
            .into())
        }
        (LuksVersion::V2, None | Some(PbkdfChoice::Argon2id)) => {
            PbkdfKind::Argon2(Argon2Variant::Argon2id)
        }
        (LuksVersion::V2, Some(PbkdfChoice::Argon2i)) => PbkdfKind::Argon2(Argon2Variant::Argon2i),
        (LuksVersion::V2, Some(PbkdfChoice::Pbkdf2)) => PbkdfKind::Pbkdf2,
    };
    if let Some(ms) = args.iter_time {
        if ms == 0 {
            return Err(UsageError("--iter-time must be at least 1 ms".into()).into());
        }
        opts.iter_time_ms = ms;
    }
    if let Some(kib) = args.pbkdf_memory {
        if !(8..=4 * 1024 * 1024).contains(&kib) {
            return Err(
                UsageError("--pbkdf-memory must be between 8 and 4194304 KiB".into()).into(),
            );
        }
        opts.memory_kib = kib;
    } else {
        opts.memory_kib = PbkdfOptions::default_argon2_memory_kib();
    }
    if let Some(p) = args.pbkdf_parallel {
        if !(1..=16).contains(&p) {
            return Err(UsageError("--pbkdf-parallel must be between 1 and 16".into()).into());
        }
        opts.parallel = p;
    }
    if let Some(n) = args.pbkdf_force_iterations {
        if n == 0 {
            return Err(UsageError("--pbkdf-force-iterations must be at least 1".into()).into());
        }
        opts.force_iterations = Some(n);
    }
    Ok(opts)
}

pub fn format_options(args: &LuksFormatArgs) -> Result<FormatOptions> {
    let version = match args.luks_type {
        LuksType::Luks1 => LuksVersion::V1,
        LuksType::Luks2 => LuksVersion::V2,
    };
    let hash = HashAlg::parse(&args.hash)?;
    let bits = match args.key_size {
        Some(bits) => bits,
        None => CipherSpec::default_key_bits(&args.cipher)?,
    };
    if !bits.is_multiple_of(8) {
        return Err(UsageError(format!("--key-size {bits} is not a whole number of bytes")).into());
    }
    let cipher = CipherSpec::parse_luks2(&args.cipher, bits / 8)?;
    let sector_size = match (version, args.sector_size) {
        (LuksVersion::V1, None | Some(512)) => 512,
        (LuksVersion::V1, Some(s)) => {
            return Err(UsageError(format!("LUKS1 only supports 512-byte sectors, not {s}")).into())
        }
        (LuksVersion::V2, None) => 4096,
        (LuksVersion::V2, Some(s)) if s.is_power_of_two() && (512..=4096).contains(&s) => s,
        (LuksVersion::V2, Some(s)) => {
            return Err(UsageError(format!(
                "--sector-size {s}: use a power of two from 512 to 4096"
            ))
            .into())
        }
    };
    if version == LuksVersion::V1 && args.label.is_some() {
        return Err(UsageError("--label needs LUKS2 (LUKS1 headers have no label)".into()).into());
    }
    Ok(FormatOptions {
        version,
        cipher,
        hash,
        pbkdf: pbkdf_options(&args.pbkdf, hash, version)?,
        sector_size,
        label: args.label.clone(),
        uuid: None,
    })
}

pub fn unlock_options(cli: &Cli) -> UnlockOptions {
    UnlockOptions {
        max_pbkdf_memory_kib: cli.max_pbkdf_memory,
        max_pbkdf2_iterations: cli.max_pbkdf_iterations,
        max_argon2_work_kib: cli.max_argon2_work,
    }
}

/// Crypto worker threads: `--threads`, else one per CPU.
pub fn pool_threads(cli: &Cli) -> Result<usize> {
    match cli.threads {
        Some(n) if (1..=1024).contains(&n) => Ok(n),
        Some(n) => Err(UsageError(format!("--threads {n}: use 1 to 1024")).into()),
        None => Ok(std::thread::available_parallelism().map_or(1, |n| n.get())),
    }
}

pub fn crypto_pool(cli: &Cli) -> Result<Arc<CryptoPool>> {
    Ok(Arc::new(CryptoPool::try_new(pool_threads(cli)?)?))
}

/// The new layout `cryptblk reencrypt` asks for (`--cipher`, `--key-size`, `--sector-size`).
pub fn new_layout(args: &ReencryptArgs) -> NewLayout<'_> {
    NewLayout {
        cipher: args.cipher.as_deref(),
        key_bits: args.key_size,
        sector_size: args.sector_size,
    }
}

/// A refused layout option as the command line spells it (`--key-size 12 ...`), a usage error.
pub fn layout_error(e: PrepareError) -> anyhow::Error {
    if e.is_bad_option() {
        UsageError(format!("--{e}")).into()
    } else {
        e.into()
    }
}
