pub mod bench;
pub mod ctl;
pub mod demo;
pub mod dump;
pub mod format;
pub mod key;
pub mod serve;
