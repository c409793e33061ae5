fn main() {
    eprintln!("cryptblk: not built yet");
    std::process::exit(1);
}
