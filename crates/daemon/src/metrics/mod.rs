//! `serve --metrics ADDR`: the daemon's statistics as a Prometheus scrape target. A small
//! HTTP/1.1 responder of our own (`server`, `http`) answers `GET /metrics` with the text
//! exposition format 0.0.4 (`exposition`), rendered at request time from a snapshot of the
//! lock-free counters the data path already keeps (`collect`). Nothing it renders comes near
//! key material: disks are named by name, image path and cipher, never by key or passphrase.
mod collect;
mod exposition;
mod http;
mod server;

pub use server::{MetricsServer, MetricsStop};

use crate::error::{Context, Error, Result};
use crate::registry::Daemon;
use std::sync::Arc;
use std::thread::JoinHandle;

/// A running metrics endpoint.
pub struct Metrics {
    pub stop: MetricsStop,
    pub thread: JoinHandle<()>,
    /// A copy of its listening socket, for a successor daemon.
    pub socket: cryptblk_net::ListeningSocket,
}

/// Binds `address` (or takes `inherited`, the socket a predecessor daemon handed over) and
/// serves it on a thread of its own; logs the address bound (a TCP port 0 resolved), which is
/// how a caller learns it.
pub fn start(
    address: &cryptblk_net::Address,
    inherited: Option<cryptblk_net::Listener>,
    daemon: Arc<Daemon>,
) -> Result<Metrics> {
    let server = match inherited {
        Some(listener) => MetricsServer::on(listener, daemon),
        None => MetricsServer::bind(address, daemon)
            .map_err(|e| Error::caused(format!("metrics endpoint on {address}"), e))?,
    };
    let socket = server
        .listener()
        .handover_copy()
        .context("the metrics endpoint's socket")?;
    let bound = server
        .local_addr()
        .context("the metrics endpoint's address")?;
    tracing::info!(address = %bound, "metrics endpoint listening (GET /metrics)");
    let stop = server
        .stop_handle()
        .context("the metrics endpoint's waker")?;
    let thread = std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            if let Err(e) = server.run() {
                tracing::warn!("metrics endpoint: {e}");
            }
        })
        .context("starting the metrics thread")?;
    Ok(Metrics {
        stop,
        thread,
        socket,
    })
}
