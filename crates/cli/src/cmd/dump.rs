use crate::args::DumpArgs;
use anyhow::{Context, Result};
use cryptblk_luks::LuksImage;

pub fn run(args: &DumpArgs) -> Result<()> {
    let path = &args.image;
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let (image, warnings) = LuksImage::read(&file)
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
