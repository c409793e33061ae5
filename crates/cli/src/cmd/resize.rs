//! `cryptblk resize IMAGE SIZE`: an image that is not served, grown (or shrunk) so that the
//! disk it holds is SIZE bytes.
use crate::args::ResizeArgs;
use crate::exit::UsageError;
use anyhow::{Context, Result};
use cryptblk_block::{probe_format, Container, Format, OpenOptions, RawFile};
use cryptblk_luks::LuksImage;
use cryptblk_volume::{resize_luks, resize_raw, ResizeError};

pub fn run(args: &ResizeArgs) -> Result<()> {
    // A file size limit refuses the new length with EFBIG (exit 5) instead of killing us.
    cryptblk_daemon::ignore_file_size_signal()?;
    let path = &args.image;
    let (image, format): (Box<dyn Container>, Format) = match crate::rbd::rbd_name(path) {
        Some(name) => {
            let image = crate::rbd::open(name, true)?;
            let luks = LuksImage::probe(&image)
                .with_context(|| format!("reading the start of {}", path.display()))?;
            let format = if luks { Format::Luks } else { Format::Raw };
            (Box::new(image), format)
        }
        None => {
            let format =
                probe_format(path).with_context(|| format!("probing {}", path.display()))?;
            if !matches!(format, Format::Luks | Format::Raw) {
                return Err(UsageError(format!(
                    "{} is {}: cryptblk resizes raw and LUKS images (qemu-img resize resizes \
                     this one)",
                    path.display(),
                    format.name()
                ))
                .into());
            }
            let file = RawFile::open(
                path,
                OpenOptions {
                    writable: true,
                    lock: true,
                },
            )?;
            (Box::new(file), format)
        }
    };
    let resized = match format {
        Format::Luks => resize_luks(image.as_ref(), args.size, args.allow_shrink),
        _ => resize_raw(image.as_ref(), args.size, args.allow_shrink),
    };
    let resized = resized.map_err(|e| match e {
        e if e.is_bad_request() => anyhow::Error::from(UsageError(e.to_string())),
        e @ ResizeError::Image { .. } => anyhow::Error::from(e).context("the resize was refused"),
        e => e.into(),
    })?;
    image
        .flush()
        .with_context(|| format!("flushing {}", path.display()))?;
    let header = if resized.header_updated {
        " (LUKS2 data segment updated in both header copies)"
    } else {
        ""
    };
    eprintln!(
        "{}: {} -> {} bytes{header}",
        path.display(),
        resized.old,
        resized.new
    );
    Ok(())
}
