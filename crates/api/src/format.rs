//! Text forms of values the API carries as numbers or bytes: UUIDs and timestamps.

/// Formats a UUID the usual way: 32 lowercase hex digits in groups of 8-4-4-4-12.
pub fn format_uuid(uuid: &[u8; 16]) -> String {
    let mut text = String::with_capacity(36);
    for (index, byte) in uuid.iter().enumerate() {
        if matches!(index, 4 | 6 | 8 | 10) {
            text.push('-');
        }
        text.push_str(&format!("{byte:02x}"));
    }
    text
}

/// Formats Unix milliseconds as an RFC 3339 UTC time to the second: `2024-05-01T12:30:00Z`.
pub fn rfc3339_utc(unix_ms: u64) -> String {
    const SECONDS_PER_DAY: u64 = 86_400;
    let seconds = unix_ms / 1000;
    let days = seconds / SECONDS_PER_DAY;
    let second_of_day = seconds % SECONDS_PER_DAY;
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        second_of_day / 3600,
        second_of_day % 3600 / 60,
        second_of_day % 60
    )
}

/// The proleptic Gregorian date of a day count since 1970-01-01.
///
/// Works in 400-year eras (146,097 days each), with years starting on March 1 so that the leap
/// day falls at the end of the year.
fn civil_from_days(days_since_epoch: u64) -> (u64, u64, u64) {
    const DAYS_PER_ERA: u64 = 146_097;
    // 1970-01-01 is 719,468 days after 0000-03-01.
    let days = days_since_epoch + 719_468;
    let era = days / DAYS_PER_ERA;
    let day_of_era = days % DAYS_PER_ERA;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 { month_from_march + 3 } else { month_from_march - 9 };
    let year = era * 400 + year_of_era + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids() {
        let uuid = [
            0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0x4d, 0xef, 0x80, 0x01, 0x02, 0x03, 0x04, 0x05,
            0x06, 0xff,
        ];
        assert_eq!(format_uuid(&uuid), "12345678-9abc-4def-8001-0203040506ff");
    }

    #[test]
    fn times() {
        let check = |unix_ms: u64, expect: &str| assert_eq!(rfc3339_utc(unix_ms), expect);
        check(0, "1970-01-01T00:00:00Z");
        check(999, "1970-01-01T00:00:00Z");
        check(951_782_400_000, "2000-02-29T00:00:00Z");
        check(951_868_799_000, "2000-02-29T23:59:59Z");
        check(1_700_000_000_000, "2023-11-14T22:13:20Z");
        check(4_107_542_400_000, "2100-03-01T00:00:00Z");
        check(1_709_164_800_000, "2024-02-29T00:00:00Z");
    }
}
