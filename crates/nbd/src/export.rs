//! The set of exports a server offers, and which connections use each, so that an export can
//! be withdrawn while clients are attached.

use crate::metadata::DirtyBitmaps;
use crate::read_pacer::ReadGate;
use crate::socket::Socket;
use crate::Error;
use cryptblk_block::{BlockDevice, IoStats};
use cryptblk_tls::AllowList;
use std::collections::{BTreeMap, HashMap};
use std::net::Shutdown;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// One device offered under a name.
pub struct Export {
    /// The NBD export name clients ask for.
    pub name: String,
    /// Sent as NBD_INFO_DESCRIPTION and in NBD_OPT_LIST replies.
    pub description: String,
    pub device: Arc<dyn BlockDevice>,
    /// Refuse writes even when the device itself is writable.
    pub read_only: bool,
    /// On a read-only export, TRIM is not a write but the client's word that it has stored
    /// the range, which the device then stops keeping (a backup export: `BackupView`'s
    /// discard). The export is announced READ_ONLY with SEND_TRIM; no other server pairs
    /// the two, so a client that sees both knows a TRIM there changes nothing it reads.
    pub trim_releases: bool,
    /// Every request on every connection to this export is recorded here.
    pub stats: Arc<IoStats>,
    /// On a TLS server: the client certificate names allowed to use this export, instead of
    /// the server's list ([`TlsCreds::with_authz`](crate::TlsCreds::with_authz)). `None`:
    /// the server's list, or any certificate the CA signed when the server has none.
    pub tls_authz: Option<AllowList>,
    /// Offered as `qemu:dirty-bitmap:NAME` metadata contexts; `None`: only `base:allocation`.
    pub dirty_bitmaps: Option<Arc<dyn DirtyBitmaps>>,
    /// When its clients' reads may start, all connections together (a rate ceiling,
    /// [`ReadPacer`](crate::ReadPacer), or an owner's schedule); `None`: at once.
    pub read_rate: Option<Arc<dyn ReadGate>>,
}

impl std::fmt::Debug for Export {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Export")
            .field("name", &self.name)
            .field("description", &self.description)
            .field("size", &self.device.size())
            .field("read_only", &self.read_only)
            .field("trim_releases", &self.trim_releases)
            .field("tls_authz", &self.tls_authz)
            .field(
                "dirty_bitmaps",
                &self.dirty_bitmaps.as_ref().map(|b| b.names()),
            )
            .field("read_rate", &self.read_rate.as_ref().map(|r| r.describe()))
            .finish()
    }
}

/// Set by a connection when it has completely finished (replies sent, device flushed).
#[derive(Default)]
struct FinishedSignal {
    done: Mutex<bool>,
    finished: Condvar,
}

impl FinishedSignal {
    fn signal(&self) {
        *lock(&self.done) = true;
        self.finished.notify_all();
    }

    fn wait(&self) {
        let mut done = lock(&self.done);
        while !*done {
            done = self
                .finished
                .wait(done)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }
}

struct AttachedConnection {
    /// A handle on the client socket; shutting down its read side makes the connection stop
    /// taking requests and wind down.
    socket: Socket,
    finished: Arc<FinishedSignal>,
}

struct Entry {
    export: Arc<Export>,
    /// Distinguishes this entry from a later export added under the same name.
    generation: u64,
    connections: HashMap<u64, AttachedConnection>,
}

/// The exports of a server. Shared as `Arc`; may be changed while the server runs.
#[derive(Default)]
pub struct ExportRegistry {
    // BTreeMap so listings come out sorted by name.
    entries: Mutex<BTreeMap<String, Entry>>,
    next_id: AtomicU64,
}

/// Poisoning only means another thread panicked while holding the lock; the maps stay
/// consistent because every critical section is a single insert/remove.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl ExportRegistry {
    pub fn new() -> Arc<Self> {
        Arc::new(ExportRegistry::default())
    }

    pub fn add(&self, export: Export) -> Result<(), Error> {
        let mut entries = lock(&self.entries);
        if entries.contains_key(&export.name) {
            return Err(Error::ExportExists(export.name));
        }
        let generation = self.next_id.fetch_add(1, Ordering::Relaxed);
        entries.insert(
            export.name.clone(),
            Entry {
                export: Arc::new(export),
                generation,
                connections: HashMap::new(),
            },
        );
        Ok(())
    }

    /// Removes the export so no new client can open it, then shuts down every connection using
    /// it gracefully (stop reading new requests, finish and reply to the in-flight ones, close),
    /// waits for them, and returns. `Error::NoSuchExport` if absent.
    pub fn remove(&self, name: &str) -> Result<(), Error> {
        let entry = lock(&self.entries)
            .remove(name)
            .ok_or_else(|| Error::NoSuchExport(name.to_owned()))?;
        for connection in entry.connections.values() {
            connection.socket.shutdown(Shutdown::Read);
        }
        for connection in entry.connections.values() {
            connection.finished.wait();
        }
        Ok(())
    }

    pub fn names(&self) -> Vec<String> {
        lock(&self.entries).keys().cloned().collect()
    }

    /// Open connections (past the handshake) to the export `name`; 0 if there is none.
    pub fn connections(&self, name: &str) -> usize {
        lock(&self.entries)
            .get(name)
            .map_or(0, |entry| entry.connections.len())
    }

    /// All exports, sorted by name, for NBD_OPT_LIST.
    pub(crate) fn list(&self) -> Vec<Arc<Export>> {
        lock(&self.entries)
            .values()
            .map(|entry| Arc::clone(&entry.export))
            .collect()
    }

    /// The export a client means by `name`. The empty name selects the only export when
    /// there is exactly one, as qemu-nbd's default export does, so `nbd+unix:///?socket=..`
    /// works against a single-disk server; with several exports it matches nothing.
    pub(crate) fn lookup(&self, name: &str) -> Option<Arc<Export>> {
        let entries = lock(&self.entries);
        resolve(&entries, name).map(|entry| Arc::clone(&entry.export))
    }

    /// Looks up `name` and registers a connection to it in one step, so that a concurrent
    /// `remove` either sees the connection (and waits for it) or the client sees no export.
    pub(crate) fn attach(self: &Arc<Self>, name: &str, socket: Socket) -> Option<Attachment> {
        let mut entries = lock(&self.entries);
        let key = resolve(&entries, name)?.export.name.clone();
        let entry = entries.get_mut(&key)?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let finished = Arc::new(FinishedSignal::default());
        entry.connections.insert(
            id,
            AttachedConnection {
                socket,
                finished: Arc::clone(&finished),
            },
        );
        Some(Attachment {
            registry: Arc::clone(self),
            export: Arc::clone(&entry.export),
            name: key,
            generation: entry.generation,
            id,
            finished,
        })
    }
}

fn resolve<'a>(entries: &'a BTreeMap<String, Entry>, name: &str) -> Option<&'a Entry> {
    match entries.get(name) {
        Some(entry) => Some(entry),
        None if name.is_empty() && entries.len() == 1 => entries.values().next(),
        None => None,
    }
}

/// A connection's registration with its export. Dropping it (after the connection has sent
/// its last reply and flushed) unregisters the connection and releases a waiting `remove`.
pub(crate) struct Attachment {
    registry: Arc<ExportRegistry>,
    export: Arc<Export>,
    name: String,
    generation: u64,
    id: u64,
    finished: Arc<FinishedSignal>,
}

impl Attachment {
    pub(crate) fn export(&self) -> &Arc<Export> {
        &self.export
    }
}

impl Drop for Attachment {
    fn drop(&mut self) {
        {
            let mut entries = lock(&self.registry.entries);
            if let Some(entry) = entries.get_mut(&self.name) {
                if entry.generation == self.generation {
                    entry.connections.remove(&self.id);
                }
            }
        }
        self.finished.signal();
    }
}
