//! Caps on the connections a listener serves at once: in all, and per peer address, so that
//! one client (or a flood of them) cannot take every slot, thread and buffer of a server.
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

/// How many connections a listener serves at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// In all.
    pub total: usize,
    /// From one IP address (TCP peers; Unix socket peers only count towards `total`).
    pub per_peer: usize,
}

/// Why a connection was refused; the message says which limit and how to raise it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitExceeded {
    #[error("{limit} connections are open already (the limit in all)")]
    Total { limit: usize },
    #[error("{limit} connections from {peer} are open already (the limit per peer address)")]
    PerPeer { peer: IpAddr, limit: usize },
}

#[derive(Debug, Default)]
struct Counts {
    total: usize,
    per_peer: HashMap<IpAddr, usize>,
}

/// Counts the open connections of one listener against its [`ConnectionLimits`].
#[derive(Debug, Clone)]
pub struct ConnectionGate {
    limits: ConnectionLimits,
    counts: Arc<Mutex<Counts>>,
}

/// One admitted connection; dropping it frees its slot.
#[derive(Debug)]
pub struct ConnectionPermit {
    peer: Option<IpAddr>,
    counts: Arc<Mutex<Counts>>,
}

impl ConnectionGate {
    pub fn new(limits: ConnectionLimits) -> Self {
        ConnectionGate {
            limits,
            counts: Arc::default(),
        }
    }

    pub fn limits(&self) -> ConnectionLimits {
        self.limits
    }

    /// Admits a connection from `peer` (`None`: a Unix socket peer) if both limits allow.
    pub fn admit(&self, peer: Option<IpAddr>) -> Result<ConnectionPermit, LimitExceeded> {
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        if counts.total >= self.limits.total {
            return Err(LimitExceeded::Total {
                limit: self.limits.total,
            });
        }
        if let Some(ip) = peer {
            let from_peer = counts.per_peer.entry(ip).or_insert(0);
            if *from_peer >= self.limits.per_peer {
                return Err(LimitExceeded::PerPeer {
                    peer: ip,
                    limit: self.limits.per_peer,
                });
            }
            *from_peer += 1;
        }
        counts.total += 1;
        Ok(ConnectionPermit {
            peer,
            counts: self.counts.clone(),
        })
    }
}

impl Drop for ConnectionPermit {
    fn drop(&mut self) {
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        counts.total -= 1;
        if let Some(ip) = self.peer {
            if let Some(n) = counts.per_peer.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    counts.per_peer.remove(&ip);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_limits_hold_and_slots_come_back() {
        let gate = ConnectionGate::new(ConnectionLimits {
            total: 3,
            per_peer: 2,
        });
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let a1 = gate.admit(Some(a)).unwrap();
        let _a2 = gate.admit(Some(a)).unwrap();
        assert_eq!(
            gate.admit(Some(a)).unwrap_err(),
            LimitExceeded::PerPeer { peer: a, limit: 2 }
        );
        let _b1 = gate.admit(Some(b)).unwrap();
        assert_eq!(
            gate.admit(None).unwrap_err(),
            LimitExceeded::Total { limit: 3 }
        );
        drop(a1);
        let _a3 = gate.admit(Some(a)).unwrap();
        assert!(gate.admit(Some(b)).is_err());
    }
}
