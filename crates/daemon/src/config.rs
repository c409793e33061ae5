//! Checking a disk's configuration (one place for every source: the command line, a
//! `--config` file, `disk-add`) and reading `--config` files.
use crate::error::InvalidConfig;
use crate::socket_access::SocketAccess;
use cryptblk_control::api::DiskConfig;
use cryptblk_vhost_user_blk::{MAX_QUEUES, MAX_QUEUE_SIZE};
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// Longest disk name (it is also an NBD export name, which NBD limits to 4096 bytes).
pub const MAX_NAME_LEN: usize = 4096;

/// Checks what can be checked without opening anything. Option names are written as in the
/// config file and the RPC params (`num-queues`); the command line's `--num-queues` is the
/// same word.
pub fn validate(config: &DiskConfig) -> Result<(), InvalidConfig> {
    let invalid = |msg: String| Err(InvalidConfig(msg));
    if config.name.is_empty() || config.name.len() > MAX_NAME_LEN {
        return invalid(format!("a disk name must be 1 to {MAX_NAME_LEN} bytes"));
    }
    if config.name.chars().any(char::is_control) {
        return invalid("control characters in the disk name".into());
    }
    if config.num_queues == 0 || config.num_queues > MAX_QUEUES {
        return invalid(format!(
            "num-queues {}: use 1 to {MAX_QUEUES}",
            config.num_queues
        ));
    }
    if !config.queue_size.is_power_of_two() || config.queue_size > MAX_QUEUE_SIZE {
        return invalid(format!(
            "queue-size {}: use a power of two up to {MAX_QUEUE_SIZE}",
            config.queue_size
        ));
    }
    tls_authz(config).map_err(|e| InvalidConfig(e.to_string()))?;
    let access = SocketAccess::of(config)?;
    if !access.is_default() && config.vhost_user_blk.is_none() {
        return invalid(
            "socket-owner, socket-mode, socket-peer-uid and socket-peer-gid apply to the \
             vhost-user-blk socket: give one"
                .into(),
        );
    }
    Ok(())
}

/// The allow-list of a disk's `tls-authz`, checked.
pub(crate) fn tls_authz(
    config: &DiskConfig,
) -> std::result::Result<Option<cryptblk_net::tls::AllowList>, TlsAuthzError> {
    config
        .tls_authz
        .as_ref()
        .map(|names| cryptblk_net::tls::AllowList::parse(names).map_err(TlsAuthzError))
        .transpose()
}

/// A disk's `tls-authz` that is not a list of certificate names.
#[derive(Debug, thiserror::Error)]
#[error("tls-authz: {0}")]
pub(crate) struct TlsAuthzError(cryptblk_net::tls::AllowListError);

impl From<TlsAuthzError> for crate::error::Error {
    fn from(e: TlsAuthzError) -> Self {
        crate::error::Error::usage(e.to_string())
    }
}

/// Every path of `config` must be absolute (the daemon's working directory is not a
/// client's).
pub fn require_absolute_paths(config: &DiskConfig) -> Result<(), InvalidConfig> {
    for path in config.paths() {
        absolute(path)?;
    }
    Ok(())
}

pub fn absolute(path: &Path) -> Result<(), InvalidConfig> {
    if path.is_absolute() {
        Ok(())
    } else {
        Err(InvalidConfig(format!(
            "{} is relative: the daemon needs absolute paths",
            path.display()
        )))
    }
}

/// Why a `--config` file was refused: the message names the file, the line or the disk.
#[derive(Debug, thiserror::Error)]
pub enum ConfigFileError {
    #[error("reading config {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {message}", path.display())]
    Invalid { path: PathBuf, message: String },
}

/// What a `--config` file holds: the disks, and the daemon's settings given there.
#[derive(Debug, Clone, PartialEq)]
pub struct ServeFile {
    pub disks: Vec<DiskConfig>,
    /// `memory-budget`: bytes (a number, or a string with a K/M/G/T suffix).
    pub memory_budget: Option<u64>,
}

/// The keys of a `--config` file besides the `[[disk]]` tables.
const SETTINGS: [&str; 1] = ["memory-budget"];

/// Reads a `--config` file: `[[disk]]` tables, each a [`DiskConfig`], and the daemon's
/// settings (`memory-budget`). Relative paths are resolved against the file's directory; a
/// disk without `serial` answers GET_ID with its name. A file without any `[[disk]]`
/// (comments only, as the packaged example) gives none: whether a daemon may start without
/// disks is its caller's decision (with a control socket it may).
pub fn load_serve_file(path: &Path) -> Result<ServeFile, ConfigFileError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigFileError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let base = path.parent().unwrap_or(Path::new(""));
    parse_serve_file(&text, base).map_err(|e| ConfigFileError::Invalid {
        path: path.to_path_buf(),
        message: e.0,
    })
}

/// The disks of a `--config` file (see [`load_serve_file`]).
pub fn load_config_file(path: &Path) -> Result<Vec<DiskConfig>, ConfigFileError> {
    load_serve_file(path).map(|file| file.disks)
}

/// Parses config text; relative paths are resolved against `base`.
pub fn parse_config(text: &str, base: &Path) -> Result<Vec<DiskConfig>, InvalidConfig> {
    parse_serve_file(text, base).map(|file| file.disks)
}

/// Parses config text with its settings; relative paths are resolved against `base`.
pub fn parse_serve_file(text: &str, base: &Path) -> Result<ServeFile, InvalidConfig> {
    let table: toml::Table = toml::from_str(text)
        .map_err(|e| toml_error(text, &e))
        .map_err(InvalidConfig)?;
    let memory_budget = table
        .get("memory-budget")
        .map(memory_budget)
        .transpose()
        .map_err(InvalidConfig)?;
    let disks = parse_disks(&table, base).map_err(InvalidConfig)?;
    Ok(ServeFile {
        disks,
        memory_budget,
    })
}

/// `memory-budget = 268435456` or `memory-budget = "256M"`.
fn memory_budget(value: &toml::Value) -> Result<u64, String> {
    let bytes = match value {
        toml::Value::Integer(n) => u64::try_from(*n).map_err(|_| "negative".to_string()),
        toml::Value::String(text) => crate::size::parse_size(text),
        _ => Err("not a size".to_string()),
    };
    // The format hint only where the format was the problem: a size below the least says so.
    let bytes = bytes
        .map_err(|e| format!("memory-budget: {e} (give bytes, or a string such as \"256M\")"))?;
    crate::memory::budget(Some(bytes))
        .map(|budget| budget.bytes)
        .map_err(|e| format!("memory-budget: {e}"))
}

fn parse_disks(table: &toml::Table, base: &Path) -> Result<Vec<DiskConfig>, String> {
    if let Some(key) = table
        .keys()
        .find(|k| k.as_str() != "disk" && !SETTINGS.contains(&k.as_str()))
    {
        return Err(format!(
            "unknown key `{key}` (the file holds [[disk]] tables and {})",
            SETTINGS.join(", ")
        ));
    }
    let entries = match table.get("disk") {
        None => return Ok(Vec::new()),
        Some(toml::Value::Array(entries)) if !entries.is_empty() => entries,
        Some(_) => return Err("`disk` must be [[disk]] tables".into()),
    };
    let mut names = HashSet::new();
    let mut sockets = HashSet::new();
    let mut disks = Vec::with_capacity(entries.len());
    for (i, value) in entries.iter().enumerate() {
        let number = i + 1;
        let what = match value.get("name").and_then(toml::Value::as_str) {
            Some(name) => format!("disk \"{name}\""),
            None => format!("disk #{number}"),
        };
        let mut disk: DiskConfig = value
            .clone()
            .try_into()
            .map_err(|e: toml::de::Error| format!("{what}: {}", e.message().trim()))?;
        if disk.name.is_empty() {
            return Err(format!("disk #{number}: empty name"));
        }
        if disk.key_fd.is_some() {
            return Err(format!(
                "{what}: key-fd names a descriptor passed with a disk-add request; a config \
                 file gives key-file"
            ));
        }
        cryptblk_control::api::key_source(disk.key_params(), "key", false)
            .map_err(|e| format!("{what}: {}", e.message))?;
        validate(&disk).map_err(|e| format!("{what}: {e}"))?;
        if !names.insert(disk.name.clone()) {
            return Err(format!("{what}: another disk has the same name"));
        }
        disk.resolve_paths(base);
        if let Some(socket) = &disk.vhost_user_blk {
            if !sockets.insert(socket.clone()) {
                return Err(format!(
                    "{what}: socket {} is already used by another disk",
                    socket.display()
                ));
            }
        }
        disk.serial.get_or_insert_with(|| disk.name.clone());
        disks.push(disk);
    }
    Ok(disks)
}

/// A TOML syntax or type error on one line: "line L, column C: message".
fn toml_error(text: &str, e: &toml::de::Error) -> String {
    let msg = e.message().trim().replace('\n', "; ");
    match e.span() {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.len() - before.rfind('\n').map_or(0, |p| p + 1) + 1;
            format!("line {line}, column {column}: {msg}")
        }
        None => msg,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cryptblk_control::api::{AioEngine, CacheMode};

    fn parse(text: &str) -> Result<Vec<DiskConfig>, String> {
        parse_config(text, Path::new("/etc/cryptblk")).map_err(|e| e.0)
    }

    #[test]
    fn a_config_file_cannot_name_a_passed_descriptor() {
        let e = parse("[[disk]]\nname = \"a\"\nimage = \"/a.luks\"\nkey-fd = 0\n").unwrap_err();
        assert!(
            e.contains("key-fd names a descriptor passed with a disk-add request"),
            "{e}"
        );
    }

    #[test]
    fn a_config_file_names_one_passphrase_per_disk() {
        let base = "[[disk]]\nname = \"a\"\nimage = \"/a.luks\"\n";
        let secret = "key-secret = \"AAAA\"\nkey-secret-iv = \"AAAA\"\n";
        let disks = parse(&format!("{base}{secret}")).unwrap();
        assert_eq!(disks[0].key_secret.as_deref(), Some("AAAA"));
        let e = parse(&format!("{base}{secret}key-file = \"/k\"\n")).unwrap_err();
        assert!(e.contains("key-file and key-secret both"), "{e}");
        let e = parse(&format!("{base}key-secret = \"AAAA\"\n")).unwrap_err();
        assert!(e.contains("key-secret needs key-secret-iv"), "{e}");
    }

    #[test]
    fn config_defaults_and_relative_paths() {
        let specs = parse(
            r#"
[[disk]]
name = "a"
image = "a.raw"
vhost-user-blk = "/run/a.sock"

[[disk]]
name = "b"
image = "/var/b.luks"
key-file = "keys/b.key"
vhost-user-blk = "b.sock"
nbd = false
num-queues = 2
queue-size = 128
readonly = true
discard = true
serial = "bee"
cache = "writeback"
aio = "threads"
"#,
        )
        .unwrap();
        assert_eq!(specs.len(), 2);
        let a = &specs[0];
        assert_eq!(a.image.path(), Path::new("/etc/cryptblk/a.raw"));
        assert_eq!(a.vhost_user_blk.as_deref(), Some(Path::new("/run/a.sock")));
        assert_eq!(a.nbd_export, None);
        assert_eq!((a.num_queues, a.queue_size), (1, 256));
        assert!(!a.readonly && !a.discard && a.key_file.is_none());
        assert_eq!(a.serial.as_deref(), Some("a"));
        assert_eq!((a.cache, a.aio), (CacheMode::None, AioEngine::IoUring));
        let b = &specs[1];
        assert_eq!(
            b.key_file.as_deref(),
            Some(Path::new("/etc/cryptblk/keys/b.key"))
        );
        assert_eq!(
            b.vhost_user_blk.as_deref(),
            Some(Path::new("/etc/cryptblk/b.sock"))
        );
        assert_eq!(b.nbd_export, Some(false));
        assert_eq!((b.num_queues, b.queue_size), (2, 128));
        assert!(b.readonly && b.discard);
        assert_eq!(b.serial.as_deref(), Some("bee"));
        assert_eq!((b.cache, b.aio), (CacheMode::Writeback, AioEngine::Threads));
    }

    #[test]
    fn config_errors_name_the_disk() {
        let e = parse("[[disk]]\nname = \"x\"\nimage = \"i\"\nvhost-user-blk = \"s\"\nbogus = 1\n")
            .unwrap_err();
        assert!(e.contains("bogus") && e.contains("\"x\""), "{e}");
        let e = parse("[[disk]]\nname = \"x\"\nvhost-user-blk = \"s\"\n").unwrap_err();
        assert!(e.contains("image") && e.contains("\"x\""), "{e}");
        let two = |a: &str, b: &str| {
            format!(
                "[[disk]]\nname = \"{a}\"\nimage = \"i1\"\nvhost-user-blk = \"s1\"\n\
                 [[disk]]\nname = \"{b}\"\nimage = \"i2\"\nvhost-user-blk = \"{}\"\n",
                if a == b { "s2" } else { "s1" }
            )
        };
        let e = parse(&two("x", "x")).unwrap_err();
        assert!(e.contains("same name"), "{e}");
        let e = parse(&two("x", "y")).unwrap_err();
        assert!(e.contains("socket") && e.contains("\"y\""), "{e}");
        let e = parse(
            "[[disk]]\nname = \"q\"\nimage = \"i\"\nvhost-user-blk = \"s\"\nqueue-size = 100\n",
        )
        .unwrap_err();
        assert!(e.contains("queue-size 100") && e.contains("\"q\""), "{e}");
        let e = parse("[[disk]]\nname = \"c\"\nimage = \"i\"\ncache = \"fast\"\n").unwrap_err();
        assert!(e.contains("fast") && e.contains("\"c\""), "{e}");
        assert!(parse("# no disk yet\n").unwrap().is_empty());
        let e = parse("[[disk]\n").unwrap_err();
        assert!(e.starts_with("line 1"), "{e}");
        let e = parse("extra = 1\n[[disk]]\nname = \"x\"\nimage = \"i\"\nvhost-user-blk = \"s\"\n")
            .unwrap_err();
        assert!(e.contains("extra"), "{e}");
    }

    #[test]
    fn a_config_file_sets_the_memory_budget() {
        let disk = "[[disk]]\nname = \"a\"\nimage = \"/a.raw\"\n";
        let file = |head: &str| parse_serve_file(&format!("{head}\n{disk}"), Path::new("/"));
        assert_eq!(file("").unwrap().memory_budget, None);
        assert_eq!(
            file("memory-budget = \"256M\"").unwrap().memory_budget,
            Some(256 << 20)
        );
        assert_eq!(
            file("memory-budget = 134217728").unwrap().memory_budget,
            Some(128 << 20)
        );
        let e = file("memory-budget = \"1M\"").unwrap_err().0;
        assert!(
            e.contains("memory-budget") && e.contains("at least 64 MiB"),
            "{e}"
        );
        assert!(
            !e.contains("give bytes"),
            "a well-formed size is not told its format: {e}"
        );
        let e = file("memory-budget = \"lots\"").unwrap_err().0;
        assert!(e.contains("memory-budget") && e.contains("lots"), "{e}");
        assert!(e.contains("give bytes"), "{e}");
        let e = file("memory-budget = true").unwrap_err().0;
        assert!(e.contains("memory-budget: not a size"), "{e}");
        assert_eq!(file("memory-budget = \"1G\"").unwrap().disks.len(), 1);
    }

    #[test]
    fn validation_names_the_setting() {
        let mut c = DiskConfig::new("d", cryptblk_control::api::ImageName::new("/i"));
        assert_eq!(validate(&c), Ok(()));
        c.num_queues = 0;
        assert!(validate(&c).unwrap_err().0.contains("num-queues 0"));
        c.num_queues = 1;
        c.queue_size = 2048;
        assert!(validate(&c).unwrap_err().0.contains("queue-size 2048"));
        c.queue_size = 256;
        c.name = String::new();
        assert!(validate(&c).unwrap_err().0.contains("1 to 4096 bytes"));
        c.name = "a\nb".into();
        assert!(validate(&c).unwrap_err().0.contains("control characters"));
    }
}
