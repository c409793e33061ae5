//! Growing a LUKS2 disk that lives in Ceph RBD (a throwaway single-node cluster): offline with
//! `cryptblk resize rbd:...`, then while served with `ctl disk-resize`, seen by new NBD
//! clients; librbd's own encryption (through QEMU's rbd driver) then reads the grown disk on
//! the host, the data before the old end and after it.
mod common;

use common::*;
use cryptblk_testutil::ceph;

fn nbd_size(uri: &str) -> u64 {
    let out = tool("nbdinfo", ["--size", uri]);
    out.ok();
    out.stdout.trim().parse().unwrap()
}

#[test]
fn luks2_in_rbd_grows_offline_and_while_served() {
    let Some(cluster) = ceph::start() else {
        return;
    };
    let t = TestDir::new();
    let key = t.key("key");
    let name = cluster.name("grown");
    format_luks2(std::path::Path::new(&name), &key, "16M");
    let librbd = vec![
        "--object".to_string(),
        format!("secret,id=s0,file={}", s(&key)),
        "--image-opts".to_string(),
        format!(
            "driver=rbd,pool=rbd,image=grown,conf={},encrypt.format=luks2,encrypt.key-secret=s0",
            cluster.conf.display()
        ),
    ];
    qemu_io_cmds(&librbd, &["write -P 0x5a 15M 1M"]);

    // Offline: the RBD image grows by what the payload gains.
    let image_size = |cluster: &ceph::Cluster| -> u64 {
        let info: serde_json::Value =
            serde_json::from_str(&cluster.rbd(&["info", "--format", "json", "grown"])).unwrap();
        info["size"].as_u64().unwrap()
    };
    let before = image_size(&cluster);
    cryptblk(["resize", &name, "24M"]).ok();
    assert_eq!(image_size(&cluster), before + 8 * MIB);

    // Online: served over NBD, grown again; new clients see it and write past the old end.
    let serve = t.serve().control().image(&name).key(&key).name("grown");
    let mut daemon = serve.nbd().start();
    let uri = daemon.nbd_uri("grown");
    assert_eq!(nbd_size(&uri), 24 * MIB);
    let result = daemon.ctl_ok(&["disk-resize", "grown", "32M"]);
    assert_eq!(result["size"], 32 * MIB, "{result}");
    assert_eq!(nbd_size(&uri), 32 * MIB);
    daemon.qemu_io("grown", &["read -P 0x5a 15M 1M", "write -P 0x77 31M 1M"]);
    assert_eq!(daemon.terminate(), 0);
    assert_eq!(image_size(&cluster), before + 16 * MIB);

    // librbd's encryption reads the grown disk: 32 MiB, both patterns.
    let info = tool("qemu-img", [&["info".to_string()][..], &librbd].concat());
    info.ok();
    assert!(
        info.stdout.contains("virtual size: 32 MiB"),
        "{}",
        info.stdout
    );
    qemu_io_cmds(&librbd, &["read -P 0x5a 15M 1M", "read -P 0x77 31M 1M"]);
}
