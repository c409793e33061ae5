//! Starting a server peer, waiting until it serves, stopping it: `cryptblk serve` and
//! qemu-storage-daemon, each exporting one image over vhost-user-blk or NBD on a UNIX socket
//! (SPDK's vhost target starts in `spdk.rs`, and stops here).
use crate::checkpoint;
use crate::config::{Cache, Image, Peer, Server, Transport};
use crate::images::{Images, RbdStore, POOL};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running server; killed if dropped before `stop`.
pub struct Running {
    child: Child,
    pub socket: PathBuf,
    log: PathBuf,
}

impl Running {
    pub fn new(child: Child, socket: PathBuf, log: PathBuf) -> Running {
        Running { child, socket, log }
    }

    /// The exit status once the server has exited.
    pub fn exited(&mut self) -> Result<Option<std::process::ExitStatus>> {
        Ok(self.child.try_wait()?)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The NBD URI of the export.
    pub fn uri(&self) -> String {
        format!("nbd+unix:///vol?socket={}", self.socket.display())
    }

    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// SIGTERM (a clean stop for both servers), then waits; any exit but 0 or 143 (SIGTERM
    /// itself) is worth a look and shows with the server's log.
    pub fn stop(mut self) -> Result<()> {
        // Our own child, not reaped yet (if it already exited, the wait below finds that).
        let _ = rustix::process::kill_process(
            rustix::process::Pid::from_child(&self.child),
            rustix::process::Signal::TERM,
        );
        let status = self.child.wait()?;
        use std::os::unix::process::ExitStatusExt;
        if !(status.success()
            || status.code() == Some(143)
            || status.signal() == Some(libc::SIGTERM))
        {
            bail!(
                "the server exited with {status} on SIGTERM; its log:\n{}",
                self.log_tail()
            );
        }
        Ok(())
    }

    /// SIGTERM, then SIGKILL if the server has not exited within `grace`, saying so: SPDK
    /// v24.01's vhost target can hang in its shutdown after a client left ("Timeout waiting
    /// for event: stop session") and then ignores SIGTERM.
    pub fn stop_or_kill(mut self, grace: Duration) -> Result<()> {
        // Our own child, not reaped yet (if it already exited, the wait below finds that).
        let _ = rustix::process::kill_process(
            rustix::process::Pid::from_child(&self.child),
            rustix::process::Signal::TERM,
        );
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if self.child.try_wait()?.is_some() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.child.kill()?;
        self.child.wait()?;
        let tail = self.log_tail();
        eprintln!(
            "  the server did not exit within {} s of SIGTERM: killed; its log ends:\n{}",
            grace.as_secs(),
            tail.lines().last().unwrap_or_default()
        );
        Ok(())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The command line that serves `peer`'s image over `transport` with `queues` queues.
pub fn command(
    peer: &Peer,
    cryptblk: &Path,
    images: &Images,
    transport: Transport,
    queues: u32,
    cache: Cache,
    socket: &Path,
) -> Result<Command> {
    let image = images.path(peer.image);
    let rbd = images.rbd.as_ref();
    let mut cmd;
    match peer.server {
        Server::Fio => bail!("fio is a client, not a server"),
        Server::Spdk | Server::SpdkCrypto => bail!("SPDK's vhost target starts in spdk.rs"),
        Server::Cryptblk => {
            cmd = Command::new(cryptblk);
            cmd.arg("serve");
            match transport {
                Transport::Vhost => {
                    // vu_bench's memory comes from libblkio, which does not seal it against
                    // shrinking: the server must be told to map it anyway. Its rings hold
                    // three descriptors per request (512 entries at depth 128), more than the
                    // server's default of 256: offer the largest ring.
                    cmd.arg("--vhost-user-blk")
                        .arg(socket)
                        .args(["--num-queues", &queues.to_string()])
                        .args(["--queue-size", "1024"])
                        .arg("--unsealed-memory");
                }
                Transport::Nbd => {
                    cmd.arg("--nbd")
                        .arg(format!("unix:{}", socket.display()))
                        .args(["--name", "vol"]);
                }
            }
            match rbd {
                Some(store) => cmd.arg("--image").arg(store.cryptblk_name(peer.image)),
                None => cmd.arg("--image").arg(&image),
            };
            match peer.image {
                Image::Raw => {}
                Image::Luks2 => {
                    cmd.arg("--key-file").arg(&images.key);
                }
                other => bail!(
                    "cryptblk serve does not serve '{}' images here",
                    other.label()
                ),
            }
            if cache == Cache::None {
                cmd.args(["--cache", "none"]);
            }
            cmd.args(&peer.serve_args);
            if peer.checkpoint {
                cmd.arg("--control")
                    .arg(checkpoint::control_socket(socket))
                    .args(["--name", checkpoint::DISK]);
            }
        }
        Server::Qsd => {
            cmd = Command::new("qemu-storage-daemon");
            let file_opts = match cache {
                Cache::None => ",cache.direct=on,aio=io_uring",
                Cache::Default => "",
            };
            let secret = format!("secret,id=sec0,file={}", images.key.display());
            match rbd {
                Some(store) => {
                    let mut dev = format!(
                        "driver=rbd,node-name=f,pool={},image={},conf={}",
                        POOL,
                        RbdStore::image_name(peer.image),
                        store.conf.display()
                    );
                    if peer.image == Image::RbdLuks2Librbd {
                        // librbd's own LUKS2 under QEMU's rbd driver.
                        cmd.arg("--object").arg(&secret);
                        dev.push_str(",encrypt.format=luks2,encrypt.key-secret=sec0");
                    }
                    cmd.arg("--blockdev").arg(dev);
                }
                None => {
                    cmd.arg("--blockdev").arg(format!(
                        "driver=file,node-name=f,filename={}{file_opts}",
                        image.display()
                    ));
                }
            }
            let node = match peer.image {
                Image::Raw => "f",
                Image::RbdLuks2Librbd if rbd.is_some() => "f",
                Image::Luks1 => {
                    cmd.arg("--object").arg(&secret).args([
                        "--blockdev",
                        "driver=luks,node-name=l,file=f,key-secret=sec0",
                    ]);
                    "l"
                }
                other => bail!(
                    "qemu-storage-daemon does not serve '{}' images here",
                    other.label()
                ),
            };
            match transport {
                Transport::Vhost => {
                    cmd.arg("--export").arg(format!(
                        "type=vhost-user-blk,id=e,node-name={node},addr.type=unix,addr.path={},writable=on,num-queues={queues}",
                        socket.display()
                    ));
                }
                Transport::Nbd => {
                    cmd.arg("--nbd-server")
                        .arg(format!("addr.type=unix,addr.path={}", socket.display()))
                        .arg("--export")
                        .arg(format!(
                            "type=nbd,id=e,node-name={node},name=vol,writable=on"
                        ));
                }
            }
        }
    }
    Ok(cmd)
}

/// Starts the server and returns once it serves: the vhost-user socket exists, or the NBD
/// export answers `nbdinfo --size` with the image's size.
pub fn start(
    mut cmd: Command,
    socket: &Path,
    log: &Path,
    transport: Transport,
    size: u64,
) -> Result<Running> {
    let _ = std::fs::remove_file(socket);
    crate::command::show(&cmd);
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log)?)
        .spawn()
        .with_context(|| format!("starting {}", cmd.get_program().to_string_lossy()))?;
    let mut running = Running {
        child,
        socket: socket.to_path_buf(),
        log: log.to_path_buf(),
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ready = match transport {
            Transport::Vhost => socket.exists(),
            Transport::Nbd => socket.exists() && nbd_size(&running.uri()) == Some(size),
        };
        if ready {
            return Ok(running);
        }
        if let Some(status) = running.child.try_wait()? {
            bail!(
                "the server exited ({status}) before serving; its log:\n{}",
                running.log_tail()
            );
        }
        if Instant::now() > deadline {
            bail!(
                "the server did not serve {} within 60 s; its log:\n{}",
                socket.display(),
                running.log_tail()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn nbd_size(uri: &str) -> Option<u64> {
    let out = Command::new("nbdinfo")
        .args(["--size", uri])
        .output()
        .ok()?;
    out.status.success().then_some(())?;
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn every_disk_peer_gets_the_command_line_of_the_bash_harness() {
        let c = Config::load(None).unwrap();
        let images = Images {
            dir: "/i".into(),
            key: "/i/key".into(),
            size: 1 << 30,
            rbd: None,
        };
        let s = Path::new("/w/a.sock");
        let cmd = |p: &str, t, q| {
            crate::command::command_line(
                &command(
                    c.peer(p).unwrap(),
                    Path::new("cryptblk"),
                    &images,
                    t,
                    q,
                    Cache::None,
                    s,
                )
                .unwrap(),
            )
        };
        assert_eq!(
            cmd("a", Transport::Vhost, 2),
            "cryptblk serve --vhost-user-blk /w/a.sock --num-queues 2 --queue-size 1024 --unsealed-memory --image /i/luks2.img --key-file /i/key --cache none"
        );
        assert_eq!(
            cmd("d", Transport::Nbd, 1),
            "cryptblk serve --nbd unix:/w/a.sock --name vol --image /i/raw.img --cache none"
        );
        // A peer's own serve arguments come last.
        assert_eq!(
            cmd("a-poll", Transport::Vhost, 1),
            "cryptblk serve --vhost-user-blk /w/a.sock --num-queues 1 --queue-size 1024 --unsealed-memory --image /i/luks2.img --key-file /i/key --cache none --poll-us 50"
        );
        assert_eq!(
            cmd("b", Transport::Nbd, 1),
            "qemu-storage-daemon --blockdev driver=file,node-name=f,filename=/i/luks1.img,cache.direct=on,aio=io_uring \
             --object secret,id=sec0,file=/i/key --blockdev driver=luks,node-name=l,file=f,key-secret=sec0 \
             --nbd-server addr.type=unix,addr.path=/w/a.sock --export type=nbd,id=e,node-name=l,name=vol,writable=on"
        );
        let rbd = Images {
            rbd: Some(RbdStore {
                conf: "/c/ceph.conf".into(),
            }),
            ..images.clone()
        };
        let on_rbd = |p: &str| {
            let peer = c.peer(p).unwrap();
            crate::command::command_line(
                &command(
                    peer,
                    Path::new("cryptblk"),
                    &rbd,
                    Transport::Nbd,
                    1,
                    Cache::Default,
                    s,
                )
                .unwrap(),
            )
        };
        assert!(on_rbd("a")
            .contains("--image rbd:rbd/luks2-cryptblk:conf=/c/ceph.conf --key-file /i/key"));
        assert!(on_rbd("b-librbd").starts_with(
            "qemu-storage-daemon --object secret,id=sec0,file=/i/key --blockdev \
             driver=rbd,node-name=f,pool=rbd,image=luks2-librbd,conf=/c/ceph.conf,encrypt.format=luks2,encrypt.key-secret=sec0 \
             --nbd-server"
        ), "{}", on_rbd("b-librbd"));
        assert!(on_rbd("b").contains("image=luks1-qemu,conf=/c/ceph.conf --object secret,id=sec0,file=/i/key --blockdev driver=luks,node-name=l,file=f"));
        assert!(cmd("c", Transport::Vhost, 2).ends_with(
            "--export type=vhost-user-blk,id=e,node-name=f,addr.type=unix,addr.path=/w/a.sock,writable=on,num-queues=2"
        ));
    }
}
