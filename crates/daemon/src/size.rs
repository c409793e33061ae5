//! Byte sizes as users type them: `4096`, `64M`, `1.5G`, `10GiB` (binary units, like qemu-img),
//! on the command line and in `--config` files.

/// Parse a size with an optional K/M/G/T suffix (powers of 1024; a trailing `B`/`iB` allowed).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let digits_end = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(digits_end);
    let shift = match unit
        .trim()
        .to_ascii_uppercase()
        .trim_end_matches("IB")
        .trim_end_matches('B')
    {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => {
            return Err(format!(
                "invalid size '{text}': use a number with an optional K, M, G or T suffix"
            ))
        }
    };
    let value: f64 = number
        .parse()
        .map_err(|_| format!("invalid size '{text}': not a number"))?;
    let bytes = value * (1u64 << shift) as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 / 2.0 || bytes.fract() != 0.0 {
        return Err(format!(
            "invalid size '{text}': out of range or not a whole number of bytes"
        ));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn parses_suffixes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        assert_eq!(parse_size("2KiB"), Ok(2048));
        assert_eq!(parse_size("1t"), Ok(1 << 40));
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("abc").is_err());
        assert!(parse_size("0.3K").is_err());
    }
}
