//! The passphrase params, declared once: every method that takes a passphrase takes the same
//! four keys under one prefix (`PREFIX-file`, `PREFIX-fd`, `PREFIX-secret`, `PREFIX-secret-iv`;
//! see [`super::key_source()`] for what they mean together). [`params_with_passphrases!`] puts
//! them into a params struct, with their types, serde attributes and a getter of
//! [`KeyParams`](super::KeyParams); [`passphrase_specs!`] makes their method-table entries. The
//! table test (`field_names`) holds the two to the same names.

/// Declares a params struct with one or more passphrase quads between its leading and its
/// trailing fields. A quad is written `passphrase GETTER(FILE, FD, SECRET, SECRET_IV);` with the
/// four field names (`key_file, key_fd, key_secret, key_secret_iv`, or the `new_key_*` ones),
/// and gets `fn GETTER(&self) -> KeyParams`. The struct's attributes (`deny_unknown_fields`
/// included) are kept as written.
macro_rules! params_with_passphrases {
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            $( $(#[$head_meta:meta])* pub $head:ident : $head_ty:ty, )*
            $( passphrase $getter:ident ( $file:ident, $fd:ident, $secret:ident, $iv:ident ); )+
            $( $(#[$tail_meta:meta])* pub $tail:ident : $tail_ty:ty, )*
        }
    ) => {
        $(#[$meta])*
        pub struct $name {
            $( $(#[$head_meta])* pub $head: $head_ty, )*
            $(
                /// A file holding the passphrase, read by the daemon.
                #[serde(default, skip_serializing_if = "Option::is_none")]
                pub $file: Option<std::path::PathBuf>,
                /// The index of a descriptor passed with the request (SCM_RIGHTS) that holds
                /// the passphrase.
                #[serde(default, skip_serializing_if = "Option::is_none")]
                pub $fd: Option<u32>,
                /// The passphrase encrypted with the daemon's master key (`serve
                /// --master-key-file`): base64 of the AES-256-CBC ciphertext, as QEMU's
                /// `secret` object's `data` with `keyid`.
                #[serde(default, skip_serializing_if = "Option::is_none")]
                pub $secret: Option<String>,
                /// Base64 of the 16-byte IV the secret was encrypted with.
                #[serde(default, skip_serializing_if = "Option::is_none")]
                pub $iv: Option<String>,
            )+
            $( $(#[$tail_meta])* pub $tail: $tail_ty, )*
        }

        impl $name {
            $(
                /// The params of this passphrase as the request gives them.
                pub fn $getter(&self) -> $crate::api::KeyParams<'_> {
                    $crate::api::KeyParams {
                        file: self.$file.as_deref(),
                        fd: self.$fd,
                        secret: self.$secret.as_deref(),
                        secret_iv: self.$iv.as_deref(),
                    }
                }
            )+
        }
    };
}

/// The method-table entries of one passphrase quad: `passphrase_specs!("key", "the LUKS
/// passphrase")` is `[key-file, key-fd, key-secret, key-secret-iv]`, each with its help.
macro_rules! passphrase_specs {
    ($prefix:literal, $what:literal) => {
        [
            opt(
                concat!($prefix, "-file"),
                KeyFile,
                concat!(
                    "File holding ", $what, ", read by the daemon (ctl's `-` passes its stdin as ",
                    $prefix, "-fd); this, ", $prefix, "-fd or ", $prefix, "-secret."
                ),
            ),
            opt(
                concat!($prefix, "-fd"),
                KeyFd,
                concat!(
                    "A descriptor passed with the request (SCM_RIGHTS; a pipe, memfd or file, read \
                     to its end) holding ", $what, ", instead of ", $prefix, "-file."
                ),
            ),
            opt(
                concat!($prefix, "-secret"),
                Base64,
                concat!(
                    "Base64 of ", $what, " encrypted with the daemon's master key (serve \
                     --master-key-file): the AES-256-CBC ciphertext, PKCS#7 padded (as QEMU's \
                     secret object with keyid), instead of ", $prefix, "-file."
                ),
            ),
            opt(
                concat!($prefix, "-secret-iv"),
                Base64,
                concat!(
                    "Base64 of the 16-byte IV ", $prefix,
                    "-secret was encrypted with (fresh for each secret)."
                ),
            ),
        ]
    };
}

pub(crate) use params_with_passphrases;
pub(crate) use passphrase_specs;
