use super::*;

#[test]
fn shipped_presets_load_and_name_every_script_peer() {
    let c = Config::load(None).unwrap();
    for name in ["disk", "serve", "nbd", "rbd", "demo", "spdk"] {
        c.preset(name).unwrap();
    }
    let disk = c.preset("disk").unwrap();
    assert_eq!(disk.peers, ["a", "b", "c", "d"]);
    assert_eq!(disk.storage.cache, Cache::None);
    assert_eq!(parse_size(&disk.storage.size).unwrap(), 8 << 30);
}

#[test]
fn a_ratio_naming_an_unknown_peer_is_refused_with_its_name() {
    let text = DEFAULT_CONFIG.replace(
        "ratios = [[\"a\", \"d\"]]\nrounds = 1",
        "ratios = [[\"a\", \"zz\"]]\nrounds = 1",
    );
    let path = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(path.path(), text).unwrap();
    let err = format!("{:#}", Config::load(Some(path.path())).unwrap_err());
    assert!(
        err.contains("'zz'") && err.contains("preset 'demo'"),
        "{err}"
    );
}

#[test]
fn a_checkpoint_peer_is_refused_where_no_checkpoint_can_be_kept() {
    let c = Config::load(None).unwrap();
    assert!(c.peer("a-checkpoint").unwrap().checkpoint);
    assert!(!c.peer("a").unwrap().checkpoint);
    // The nbd preset with the checkpoint peer in it: NBD is not measured with one.
    let text = DEFAULT_CONFIG.replace(
        "peers = [\"a\", \"b\", \"c\", \"d\"]\ntransports = [\"nbd\"]",
        "peers = [\"a\", \"b\", \"c\", \"d\", \"a-checkpoint\"]\ntransports = [\"nbd\"]",
    );
    assert_ne!(text, DEFAULT_CONFIG);
    let path = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(path.path(), text).unwrap();
    let err = format!("{:#}", Config::load(Some(path.path())).unwrap_err());
    assert!(
        err.contains("peer 'a-checkpoint' has a checkpoint") && err.contains("vhost"),
        "{err}"
    );
}

#[test]
fn serve_args_belong_to_cryptblk_peers_only() {
    let c = Config::load(None).unwrap();
    assert_eq!(c.peer("a-poll").unwrap().serve_args, ["--poll-us", "50"]);
    assert!(c.peer("a").unwrap().serve_args.is_empty());
    let text = DEFAULT_CONFIG.replace(
        "name = \"qemu-storage-daemon, raw\"\nserver = \"qsd\"\nimage = \"raw\"",
        "name = \"qemu-storage-daemon, raw\"\nserver = \"qsd\"\nimage = \"raw\"\nserve_args = [\"-x\"]",
    );
    assert_ne!(text, DEFAULT_CONFIG);
    let path = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(path.path(), text).unwrap();
    let err = format!("{:#}", Config::load(Some(path.path())).unwrap_err());
    assert!(
        err.contains("peer 'c' has serve_args") && err.contains("only a cryptblk peer"),
        "{err}"
    );
}

#[test]
fn spdk_peers_serve_the_raw_image_over_vhost_only() {
    let c = Config::load(None).unwrap();
    let spdk = c.preset("spdk").unwrap();
    assert_eq!(spdk.peers, ["a", "d", "e", "e-plain"]);
    assert_eq!(c.peer("e").unwrap().server, Server::SpdkCrypto);
    assert_eq!(c.peer("e-plain").unwrap().server, Server::Spdk);
    // The same preset with NBD added is refused, naming the peer and what it can do.
    let text = DEFAULT_CONFIG.replace(
        "peers = [\"a\", \"d\", \"e\", \"e-plain\"]\ntransports = [\"vhost\"]",
        "peers = [\"a\", \"d\", \"e\", \"e-plain\"]\ntransports = [\"vhost\", \"nbd\"]",
    );
    assert_ne!(text, DEFAULT_CONFIG);
    let path = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(path.path(), text).unwrap();
    let err = format!("{:#}", Config::load(Some(path.path())).unwrap_err());
    assert!(
        err.contains("peer 'e' is SPDK") && err.contains("vhost only"),
        "{err}"
    );
}

#[test]
fn a_preset_narrows_to_the_names_given_in_its_own_order() {
    let c = Config::load(None).unwrap();
    let disk = c.preset("disk").unwrap();
    let p = disk
        .narrowed(
            Some(&["d".into(), "a".into()]),
            Some(&[Transport::Nbd]),
            Some(&["w64k-d16".into()]),
        )
        .unwrap();
    assert_eq!(p.peers, ["a", "d"]);
    assert_eq!(p.transports, [Transport::Nbd]);
    assert_eq!(p.workloads, ["w64k-d16"]);
    // a/b and c/f name peers no longer measured; a/d and d/f stay.
    assert_eq!(p.ratios, [Figure::pair("a", "d"), Figure::pair("d", "f")]);
    let err = disk.narrowed(Some(&["zz".into()]), None, None).unwrap_err();
    assert!(err.to_string().contains("\"zz\""), "{err}");
}

#[test]
fn a_baseline_twins_each_cryptblk_peer_right_after_it() {
    let mut c = Config::load(None).unwrap();
    let mut disk = c.preset("disk").unwrap().clone();
    c.add_baseline(&mut disk);
    // b and c are qemu-storage-daemon: no twin.
    assert_eq!(disk.peers, ["a", "a-base", "b", "c", "d", "d-base"]);
    assert!(c.peer("a-base").unwrap().baseline && !c.peer("a").unwrap().baseline);
    assert_eq!(c.peer("a-base").unwrap().image, Image::Luks2);
    assert!(disk.ratios.contains(&Figure::pair("a", "a-base")));
    assert!(disk.ratios.contains(&Figure::pair("d", "d-base")));
}

#[test]
fn sizes_parse_like_qemu_img() {
    assert_eq!(parse_size("256M").unwrap(), 256 << 20);
    assert_eq!(parse_size("4k").unwrap(), 4096);
    assert_eq!(parse_size("512").unwrap(), 512);
    assert!(parse_size("0").is_err());
    assert!(parse_size("1X").is_err());
}
