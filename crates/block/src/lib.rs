//! Block devices for cryptblk: the `BlockDevice` abstraction, raw and qcow2 backends, and the
//! encrypted volume that sits between frontends and backends.
