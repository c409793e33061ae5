use crate::args::DumpArgs;
use anyhow::{Context, Result};
use cryptblk_luks::{HeaderIo, LuksImage};

pub fn run(args: &DumpArgs) -> Result<()> {
    let path = &args.image;
    let header: Box<dyn HeaderIo> = match crate::rbd::rbd_name(path) {
        Some(name) => Box::new(crate::rbd::open(name, false)?),
        None => Box::new(
            std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?,
        ),
    };
    let (image, warnings) = LuksImage::read(&*header)
        .with_context(|| format!("reading the LUKS header of {}", path.display()))?;
    for warning in &warnings {
        eprintln!("cryptblk: warning: {}: {warning}", path.display());
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&image.dump_json())?);
    } else {
        print!("{}", image.dump_text());
    }
    Ok(())
}
