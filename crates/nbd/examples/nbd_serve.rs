//! Serves one image over NBD until killed, for trying clients and benchmarking:
//!
//! ```sh
//! cargo run --release -p cryptblk-nbd --example nbd_serve -- IMAGE SOCKET [KEY_FILE] [QUEUE_DEPTH]
//! ```
//!
//! Without KEY_FILE the image is served raw; with it, IMAGE is opened as a LUKS volume whose
//! passphrase is the key file's contents. The export is named "disk".

use cryptblk_block::{BlockDevice, IoStats, OpenOptions, RawFile};
use cryptblk_nbd::{Export, ExportRegistry, NbdAddress, NbdServer};
use cryptblk_volume::{open_luks_volume, VolumeOptions};
use std::sync::Arc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 2 {
        return Err("usage: nbd_serve IMAGE SOCKET [KEY_FILE|-] [QUEUE_DEPTH]".into());
    }
    let image = &args[0];
    let socket = &args[1];
    let key_file = args.get(2).filter(|k| k.as_str() != "-");
    let device: Arc<dyn BlockDevice> = match key_file {
        Some(key_file) => {
            let passphrase = std::fs::read(key_file)?;
            let options = VolumeOptions {
                writable: true,
                ..Default::default()
            };
            Arc::new(open_luks_volume(image, &passphrase, &options)?)
        }
        None => Arc::new(RawFile::open(
            image,
            OpenOptions {
                writable: true,
                lock: true,
            },
        )?),
    };
    let registry = ExportRegistry::new();
    registry.add(Export {
        name: "disk".into(),
        description: image.clone(),
        device,
        read_only: false,
        stats: Arc::new(IoStats::default()),
        tls_authz: None,
        dirty_bitmaps: None,
        read_rate: None,
        trim_releases: false,
    })?;
    let address: NbdAddress = format!("unix:{socket}").parse()?;
    let mut server = NbdServer::bind(&address, registry, None)?;
    if let Some(depth) = args.get(3) {
        server = server.with_queue_depth(depth.parse()?);
    }
    println!("nbd+unix:///disk?socket={}", server.local_addr());
    server.run()?;
    Ok(())
}
