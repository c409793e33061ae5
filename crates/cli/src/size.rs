//! Byte sizes as users type them: the daemon's parser (the config file takes the same).
pub use cryptblk_daemon::size::parse_size;
