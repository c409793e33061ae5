//! The daemon's control API: the methods, their params and answers, and the error kinds. The
//! server (`cryptblk-daemon`) and the client (`cryptblk ctl`) both use these types, so the two
//! cannot drift apart.
mod backup;
mod catalogue;
mod checkpoint;
mod disk;
mod error_kind;
mod field_names;
mod io_options;
mod key_source;
mod methods;
mod passphrase_params;
mod reencrypt;
mod results;

pub use backup::{
    BackupEndParams, BackupEnded, BackupStartParams, BackupStarted, DEFAULT_BACKGROUND_SHARE,
    DEFAULT_SCRATCH_SIZE,
};
pub use catalogue::{
    errors_reference, method, methods_reference, MethodSpec, ParamKind, ParamSpec,
    CONFIG_FILE_ALIASES, METHODS,
};
pub use checkpoint::{
    CheckpointAdded, CheckpointInfo, CheckpointList, CheckpointListParams, CheckpointParams,
    CheckpointRemoved, MAX_LISTED_EXTENTS,
};
pub use disk::{rbd_name, resolve, DiskConfig, ImageName, RBD_PREFIX};
pub use error_kind::ErrorKind;
pub use field_names::accepted_params;
pub use io_options::{AioEngine, CacheMode, UnknownName};
pub use key_source::{key_source, KeyParams, KeySource};
pub use methods::{
    DiskRemoveParams, DiskResizeParams, KeyAddParams, KeyRemoveParams, MigrateIncomingParams,
    MigrateRecoverParams, MigrateStartParams, MigrateSwitchoverParams, NameParams, NoParams, Pbkdf,
    Request, StatsParams, UpgradeParams, DEFAULT_CONNECT_TIMEOUT_MS,
};
pub use reencrypt::{Hotzone, ReencryptPhase, ReencryptStartParams, ReencryptStatus, Resilience};
pub use results::*;
