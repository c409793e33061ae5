//! The command-line contract. cryptsetup and qemu-img users should recognise every option.
pub(crate) mod ctl;
mod serve;

pub use serve::{LogFormat, ServeArgs};

use crate::size::parse_size;
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "cryptblk",
    version,
    about = "Fast userspace encrypted block storage: LUKS1/LUKS2 images with parallel sector crypto",
    after_help = crate::exit::HELP,
    long_about = concat!(
        "Fast userspace encrypted block storage: LUKS1/LUKS2 images with parallel sector crypto.\n\n",
        "Passphrases are read from --key-file PATH (the whole file, as cryptsetup does; '-' reads stdin, ",
        "/dev/fd/N works), or asked for without echo when stdin is a terminal. They are never taken from ",
        "the command line.\n\nEnvironment: CRYPTBLK_ENGINE=vaes|openssl|rustcrypto forces a crypto engine ",
        "as --crypto-engine does (the option wins); ",
        "RUST_LOG=debug shows what cryptblk decides."
    )
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,

    /// Crypto worker threads (default: one per CPU).
    #[arg(long, global = true, value_name = "N")]
    pub threads: Option<usize>,

    /// Sector-crypto engine for every disk and image this command opens: vaes (AES-XTS on
    /// 256-bit VAES registers, x86-64 CPUs with VAES), openssl, or rustcrypto (portable).
    /// Default: the fastest engine for each cipher, measured on this CPU at its first use
    /// (`cryptblk bench` shows them all). A cipher the forced engine cannot run is refused;
    /// with a list (vaes,openssl) each cipher takes the first listed engine that runs it.
    #[arg(long, global = true, value_name = "NAME[,NAME]", value_parser = parse_engine_list)]
    pub crypto_engine: Option<String>,

    /// Refuse to unlock argon2 keyslots needing more memory than this many KiB.
    #[arg(long, global = true, value_name = "KIB", default_value_t = 4 * 1024 * 1024)]
    pub max_pbkdf_memory: u64,

    /// Refuse to unlock PBKDF2 keyslots (and volume-key digests) with more iterations than
    /// this: a damaged or hostile header can name billions, making one unlock run for hours.
    #[arg(long, global = true, value_name = "N",
          default_value_t = cryptblk_luks::DEFAULT_MAX_PBKDF2_ITERATIONS)]
    pub max_pbkdf_iterations: u32,

    /// Refuse to unlock argon2 keyslots whose time cost times memory cost (KiB) is above this
    /// (default 128 GiB filled, a minute or two of CPU time).
    #[arg(long, global = true, value_name = "KIB",
          default_value_t = cryptblk_luks::DEFAULT_MAX_ARGON2_WORK_KIB)]
    pub max_argon2_work: u64,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Create a LUKS2 (default) or LUKS1 image, or format an existing file in place.
    Format(FormatArgs),
    /// Show a LUKS header like `cryptsetup luksDump` (no secrets).
    Dump(DumpArgs),
    /// Add, remove or change keyslot passphrases.
    #[command(subcommand)]
    Key(KeyCommand),
    /// Copy an image between raw, qcow2 and LUKS, encrypting or decrypting on all cores.
    #[command(after_help = crate::help::CONVERT_MEMORY)]
    Convert(ConvertArgs),
    /// Re-encrypt a LUKS2 image offline with a new volume key (and optionally a new cipher,
    /// key size or sector size), crash-safe and resumable by cryptsetup too.
    #[command(after_help = crate::help::REENCRYPT)]
    Reencrypt(ReencryptArgs),
    /// Grow (or shrink) an image that is not being served so that the disk it holds is SIZE
    /// bytes, as `virsh blockresize` counts: raw, LUKS1 and LUKS2 files and rbd: images. No
    /// passphrase is needed. A served disk is resized with `cryptblk ctl disk-resize`.
    #[command(after_help = crate::help::RESIZE)]
    Resize(ResizeArgs),
    /// Convert a LUKS1 image's header to LUKS2 in place, as `cryptsetup convert --type luks2`
    /// (same volume key, payload and passphrases; no passphrase needed).
    #[command(after_help = crate::help::CONVERT_HEADER)]
    ConvertHeader(ConvertHeaderArgs),
    /// Back up an image's own bytes (ciphertext and LUKS header, no key) from an NBD export
    /// into a chain of full and incremental entries; restore any checkpoint; verify a chain.
    #[command(subcommand)]
    Backup(BackupCommand),
    /// Measure sector-crypto throughput of every engine on this CPU.
    Bench(BenchArgs),
    /// Run the built-in example: make a sample disk, encrypt it into LUKS2, decrypt and verify,
    /// then serve it to a vhost-user-blk client next to its plaintext and compare.
    Demo(DemoArgs),
    /// Run the daemon: export images (LUKS1, LUKS2 or raw) to VMs over vhost-user-blk and to
    /// tools over NBD; one from options, several from a TOML config, more at run time
    /// through the control socket.
    #[command(after_help = crate::help::SERVE)]
    Serve(ServeArgs),
    /// Drive a running daemon through its control socket (`cryptblk serve --control PATH`).
    Ctl(ctl::CtlArgs),
    /// Print a shell completion script, e.g. `cryptblk completions bash >
    /// /usr/share/bash-completion/completions/cryptblk`.
    Completions(CompletionsArgs),
    /// Write the man pages: cryptblk(1) and one per command (cryptblk-serve(1), ...); without
    /// --dir, cryptblk(1) on stdout.
    Man(ManArgs),
}

#[derive(Subcommand, Debug)]
pub enum BackupCommand {
    /// Pull one entry into the chain in DIR: a full backup (the export's allocated extents) or,
    /// with --incremental, the extents a dirty bitmap reports changed since the chain's last
    /// checkpoint. Resumable: after an interruption the same command continues.
    #[command(after_help = crate::help::BACKUP_PULL)]
    Pull(BackupPullArgs),
    /// Rebuild the image as of a checkpoint of the chain (default: the last), sparse, into a
    /// new file. It opens with the source's passphrase.
    Restore(BackupRestoreArgs),
    /// Check every entry's checksums and the chain's continuity; names the damaged entries.
    Verify(BackupVerifyArgs),
}

#[derive(Args, Debug)]
pub struct BackupPullArgs {
    /// Pull only what the dirty bitmap reports changed since the chain's last checkpoint.
    #[arg(long)]
    pub incremental: bool,
    /// The dirty bitmap an incremental reads (`qemu:dirty-bitmap:NAME`); default: the name of
    /// the chain's last checkpoint. It must record every change since that checkpoint.
    #[arg(long, value_name = "NAME", requires = "incremental")]
    pub bitmap: Option<String>,
    /// The new entry's checkpoint name (default: the time, YYYYMMDDTHHMMSSZ in UTC).
    #[arg(long, value_name = "NAME")]
    pub checkpoint: Option<String>,
    /// Do not tell a cryptblk backup export what is stored (by default the export then stops
    /// keeping it, and copies nothing more there): give this when another client reads the
    /// same export.
    #[arg(long)]
    pub no_release: bool,
    /// Show progress: -p for a bar, --progress=json for JSON lines.
    #[arg(short = 'p', long = "progress", value_enum, num_args = 0..=1, require_equals = true,
          default_missing_value = "bar", value_name = "MODE")]
    pub progress: Option<ProgressMode>,
    /// The export: nbd+unix:///EXPORT?socket=PATH or nbd://HOST:PORT/EXPORT (PORT 10809 when left out).
    pub uri: String,
    /// The chain's directory (created if missing).
    pub dir: PathBuf,
}

#[derive(Args, Debug)]
pub struct BackupRestoreArgs {
    /// The checkpoint to restore (default: the chain's last).
    #[arg(long, value_name = "NAME")]
    pub checkpoint: Option<String>,
    /// Show progress: -p for a bar, --progress=json for JSON lines.
    #[arg(short = 'p', long = "progress", value_enum, num_args = 0..=1, require_equals = true,
          default_missing_value = "bar", value_name = "MODE")]
    pub progress: Option<ProgressMode>,
    /// The chain's directory.
    pub dir: PathBuf,
    /// The image to write (must not exist).
    pub image: PathBuf,
}

#[derive(Args, Debug)]
pub struct BackupVerifyArgs {
    /// The chain's directory.
    pub dir: PathBuf,
}

#[derive(Args, Debug)]
pub struct CompletionsArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

#[derive(Args, Debug)]
pub struct ManArgs {
    /// Write every page into this directory (created if missing).
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
}

#[derive(Args, Debug, Clone)]
pub struct PbkdfArgs {
    /// Key derivation for new keyslots (LUKS1 always uses pbkdf2).
    #[arg(long, value_enum)]
    pub pbkdf: Option<PbkdfChoice>,
    /// Target unlock time in milliseconds; the KDF cost is benchmarked to reach it.
    #[arg(long, short = 'i', value_name = "MS")]
    pub iter_time: Option<u32>,
    /// argon2 memory cost in KiB.
    #[arg(long, value_name = "KIB")]
    pub pbkdf_memory: Option<u32>,
    /// argon2 parallel threads.
    #[arg(long, value_name = "N")]
    pub pbkdf_parallel: Option<u32>,
    /// Fixed PBKDF2 iterations or argon2 time cost (skips the benchmark).
    #[arg(long, value_name = "N")]
    pub pbkdf_force_iterations: Option<u32>,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PbkdfChoice {
    Pbkdf2,
    Argon2i,
    Argon2id,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LuksType {
    Luks1,
    Luks2,
}

#[derive(Args, Debug, Clone)]
pub struct LuksFormatArgs {
    /// LUKS version to create.
    #[arg(long = "type", value_enum, default_value = "luks2")]
    pub luks_type: LuksType,
    /// Cipher in cryptsetup notation: aes-xts-plain64, aes-cbc-essiv:sha256, aes-cbc-plain64, ...
    #[arg(long, short = 'c', default_value = "aes-xts-plain64")]
    pub cipher: String,
    /// Volume key size in bits (default: 512 for XTS, 256 for CBC).
    #[arg(long, short = 's', value_name = "BITS")]
    pub key_size: Option<usize>,
    /// Hash for the AF splitter, digest and PBKDF2.
    #[arg(long, short = 'h', default_value = "sha256")]
    pub hash: String,
    /// Encryption sector size in bytes (LUKS2: 512 or 4096, default 4096; LUKS1: 512).
    #[arg(long, value_name = "BYTES")]
    pub sector_size: Option<u32>,
    /// LUKS2 label.
    #[arg(long)]
    pub label: Option<String>,
    #[command(flatten)]
    pub pbkdf: PbkdfArgs,
}

#[derive(Args, Debug)]
#[command(disable_help_flag = true)]
pub struct FormatArgs {
    /// Do not ask for confirmation before overwriting (only asked on a terminal).
    #[arg(short = 'q', long = "batch-mode", visible_alias = "quiet")]
    pub batch: bool,
    #[command(flatten)]
    pub luks: LuksFormatArgs,
    /// File holding the passphrase for keyslot 0 ('-' for stdin).
    #[arg(long, short = 'd', value_name = "FILE")]
    pub key_file: Option<PathBuf>,
    /// Image to create (with SIZE) or to format in place (without SIZE): a file, or
    /// `rbd:POOL/IMAGE[:conf=PATH][:id=USER][:keyring=PATH]` (created with the header's 16 MiB
    /// plus SIZE, or formatted in place as `rbd encryption format` does).
    pub image: PathBuf,
    /// Payload size to create, e.g. 10G (suffixes K, M, G, T).
    #[arg(value_parser = parse_size)]
    pub size: Option<u64>,
    /// Print help.
    #[arg(long, action = clap::ArgAction::Help)]
    pub help: Option<bool>,
}

/// One engine name, or several separated by commas, each one cryptblk knows.
fn parse_engine_list(s: &str) -> Result<String, String> {
    let names: Vec<String> = s
        .split(',')
        .map(|n| n.trim().to_ascii_lowercase())
        .collect();
    match names
        .iter()
        .find(|n| !cryptblk_crypto::ENGINE_NAMES.contains(&n.as_str()))
    {
        Some(bad) => Err(format!(
            "unknown crypto engine '{bad}' (known: {})",
            cryptblk_crypto::ENGINE_NAMES.join(", ")
        )),
        None => Ok(names.join(",")),
    }
}

#[derive(Args, Debug)]
pub struct DumpArgs {
    /// Machine-readable JSON.
    #[arg(long)]
    pub json: bool,
    /// A file, or `rbd:POOL/IMAGE[@SNAP][:conf=PATH][:id=USER][:keyring=PATH]`.
    pub image: PathBuf,
}

#[derive(Subcommand, Debug)]
pub enum KeyCommand {
    /// Add a keyslot with a new passphrase (an existing passphrase unlocks the volume key).
    Add(KeyAddArgs),
    /// Remove the keyslot that the given passphrase opens.
    Remove(KeyRemoveArgs),
    /// Change a passphrase: a new keyslot is written before the old one is removed.
    Change(KeyChangeArgs),
}

#[derive(Args, Debug)]
pub struct KeyAddArgs {
    /// An existing passphrase ('-' for stdin).
    #[arg(long, short = 'd', value_name = "FILE")]
    pub key_file: Option<PathBuf>,
    /// The new passphrase ('-' for stdin).
    #[arg(long, value_name = "FILE")]
    pub new_key_file: Option<PathBuf>,
    /// Keyslot number for the new passphrase (default: the first free one).
    #[arg(long, short = 'S', value_name = "N")]
    pub key_slot: Option<usize>,
    #[command(flatten)]
    pub pbkdf: PbkdfArgs,
    /// A file, or `rbd:POOL/IMAGE[:conf=PATH][:id=USER][:keyring=PATH]` (under its exclusive lock).
    pub image: PathBuf,
}

#[derive(Args, Debug)]
pub struct KeyRemoveArgs {
    /// The passphrase whose keyslot is removed ('-' for stdin).
    #[arg(long, short = 'd', value_name = "FILE")]
    pub key_file: Option<PathBuf>,
    /// Allow removing the last keyslot (the data becomes unrecoverable).
    #[arg(long)]
    pub force: bool,
    /// A file, or `rbd:POOL/IMAGE[:conf=PATH][:id=USER][:keyring=PATH]` (under its exclusive lock).
    pub image: PathBuf,
}

#[derive(Args, Debug)]
pub struct KeyChangeArgs {
    /// The current passphrase ('-' for stdin).
    #[arg(long, short = 'd', value_name = "FILE")]
    pub key_file: Option<PathBuf>,
    /// The new passphrase ('-' for stdin).
    #[arg(long, value_name = "FILE")]
    pub new_key_file: Option<PathBuf>,
    #[command(flatten)]
    pub pbkdf: PbkdfArgs,
    /// A file, or `rbd:POOL/IMAGE[:conf=PATH][:id=USER][:keyring=PATH]` (under its exclusive lock).
    pub image: PathBuf,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceFormat {
    Raw,
    Qcow2,
    Luks,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum TargetFormat {
    Raw,
    Luks1,
    Luks2,
    /// An existing LUKS image (with -n), either version.
    Luks,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheMode {
    /// Write around the page cache with O_DIRECT (falls back where the filesystem refuses it).
    None,
    /// Write through the page cache.
    Writeback,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProgressMode {
    /// A progress bar with throughput and ETA (on a terminal).
    Bar,
    /// One JSON object per line on stderr.
    Json,
}

#[derive(Args, Debug)]
#[command(disable_help_flag = true)]
pub struct ConvertArgs {
    /// Source format (probed when absent).
    #[arg(short = 'f', value_enum)]
    pub source_format: Option<SourceFormat>,
    /// Target format.
    #[arg(short = 'O', value_enum, default_value = "luks2")]
    pub target_format: TargetFormat,
    /// Write into an existing target (its LUKS header is kept), like qemu-img convert -n.
    #[arg(short = 'n')]
    pub existing_target: bool,
    /// Show progress: -p for a bar, --progress=json for JSON lines.
    #[arg(short = 'p', long = "progress", value_enum, num_args = 0..=1, require_equals = true,
          default_missing_value = "bar", value_name = "MODE")]
    pub progress: Option<ProgressMode>,
    /// Passphrase of a LUKS source ('-' for stdin).
    #[arg(long, value_name = "FILE")]
    pub source_key_file: Option<PathBuf>,
    /// Passphrase of the LUKS target ('-' for stdin).
    #[arg(long, short = 'd', value_name = "FILE")]
    pub key_file: Option<PathBuf>,
    /// Cache mode for writing a new target, like qemu-img's -t.
    #[arg(short = 't', value_enum, default_value = "none", value_name = "CACHE")]
    pub target_cache: CacheMode,
    /// Bytes per pipeline chunk.
    #[arg(long, value_parser = parse_size, default_value = "1M", value_name = "SIZE")]
    pub chunk_size: u64,
    #[command(flatten)]
    pub luks: LuksFormatArgs,
    /// A file, or an RBD image: `rbd:POOL/IMAGE[@SNAP][:conf=PATH][:id=USER][:keyring=PATH]`
    /// (connecting to the cluster and each operation time out after 30 s).
    pub source: PathBuf,
    /// A new file or RBD image (created with the source's size; removed again if the convert
    /// fails), or an existing one with -n.
    pub target: PathBuf,
    /// Print help.
    #[arg(long, action = clap::ArgAction::Help)]
    pub help: Option<bool>,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResilienceMode {
    /// Hash every block of the hotzone before rewriting it (cryptsetup's default).
    Checksum,
    /// No protection: fastest, but a crash loses the hotzone being rewritten.
    None,
    /// Copy the hotzone's old ciphertext to the keyslot area before rewriting it.
    Journal,
    /// Move the data (needs --reduce-device-size; not implemented by cryptblk).
    Datashift,
}

#[derive(Args, Debug)]
pub struct ResizeArgs {
    /// A file, or `rbd:POOL/IMAGE[:conf=PATH][:id=USER][:keyring=PATH]`.
    pub image: PathBuf,
    /// The disk's new size as the guest sees it (the LUKS payload; a raw image's length),
    /// with an optional K, M, G or T suffix: a multiple of the encryption sector size (512
    /// for raw).
    #[arg(value_name = "SIZE", value_parser = crate::size::parse_size)]
    pub size: u64,
    /// Allow a size below the current one: the data past it is lost.
    #[arg(long)]
    pub allow_shrink: bool,
}

#[derive(Args, Debug)]
pub struct ConvertHeaderArgs {
    /// The header format to convert to (cryptsetup's `--type`; only luks2 is implemented).
    #[arg(long = "type", value_enum, value_name = "TYPE")]
    pub to: HeaderType,
    /// A LUKS1 image file.
    pub image: PathBuf,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeaderType {
    Luks2,
}

#[derive(Args, Debug)]
#[command(disable_help_flag = true)]
pub struct ReencryptArgs {
    /// Passphrase file ('-' for stdin); it must open the old and the new keyslot.
    #[arg(long, short = 'd', value_name = "FILE")]
    pub key_file: Option<PathBuf>,
    /// The keyslot the passphrase opens; the only one kept when the image has several.
    #[arg(long, short = 'S', value_name = "N")]
    pub key_slot: Option<usize>,
    /// New cipher, e.g. aes-xts-plain64 (default: keep the current one).
    #[arg(long, short = 'c')]
    pub cipher: Option<String>,
    /// New volume key size in bits (default: keep the current one).
    #[arg(long, short = 's', value_name = "BITS")]
    pub key_size: Option<usize>,
    /// New encryption sector size: 512, 1024, 2048 or 4096 (default: keep the current one).
    #[arg(long, value_name = "BYTES")]
    pub sector_size: Option<u32>,
    /// Hash for the new keyslot (PBKDF2, AF splitter) and its digest.
    #[arg(long, short = 'h', default_value = "sha256")]
    pub hash: String,
    #[command(flatten)]
    pub pbkdf: PbkdfArgs,
    /// How a hotzone interrupted by a crash is recovered.
    #[arg(long, value_enum, default_value = "checksum")]
    pub resilience: ResilienceMode,
    /// Hash for the checksum resilience.
    #[arg(long, default_value = "sha256")]
    pub resilience_hash: String,
    /// Largest amount of data rewritten between two metadata commits (default 64 MiB, less
    /// if the checksum area is smaller).
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub hotzone_size: Option<u64>,
    /// Only write the reencryption metadata; `--resume-only` (ours or cryptsetup's) does the work.
    #[arg(long, conflicts_with = "resume_only")]
    pub init_only: bool,
    /// Continue a reencryption started before (by cryptblk or cryptsetup).
    #[arg(long)]
    pub resume_only: bool,
    /// Encrypt a plaintext image in place (needs --reduce-device-size).
    #[arg(long, conflicts_with = "decrypt")]
    pub encrypt: bool,
    /// Decrypt the image in place: the header goes to --header FILE (which must not exist),
    /// the plaintext to offset 0 of the image (cryptsetup 2.7's layout).
    #[arg(long)]
    pub decrypt: bool,
    /// The detached header: with --decrypt, the new file the header is exported to; to
    /// continue (--resume-only), the file a decryption left.
    #[arg(long, value_name = "FILE")]
    pub header: Option<PathBuf>,
    /// With --encrypt: the header takes half of it and the data moves up by the other half;
    /// the last SIZE bytes of the plaintext are given up (cryptsetup recommends 32M).
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub reduce_device_size: Option<u64>,
    /// Accepted for cryptsetup compatibility: cryptblk always re-encrypts offline.
    #[arg(long)]
    pub force_offline_reencrypt: bool,
    /// Show progress: -p for a bar, --progress=json for JSON lines.
    #[arg(short = 'p', long = "progress", value_enum, num_args = 0..=1, require_equals = true,
          default_missing_value = "bar", value_name = "MODE")]
    pub progress: Option<ProgressMode>,
    /// The LUKS2 image file.
    pub image: PathBuf,
    /// Print help.
    #[arg(long, action = clap::ArgAction::Help)]
    pub help: Option<bool>,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Machine-readable JSON.
    #[arg(long)]
    pub json: bool,
    /// Seconds to measure each cell.
    #[arg(long, default_value_t = 0.25)]
    pub seconds: f64,
}

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Working directory for the demo files (default: ./cryptblk-demo).
    #[arg(long, default_value = "cryptblk-demo")]
    pub dir: PathBuf,
    /// Size of the generated sample disk.
    #[arg(long, value_parser = parse_size, default_value = "256M")]
    pub size: u64,
}
