//! `strftime_now(format)` for chat templates: HF's `datetime.now().strftime(format)` (Llama 3.1
//! writes "Today Date: 26 Jul 2024" with `"%d %b %Y"`, gpt-oss "Current date: 2025-08-05" with
//! `"%Y-%m-%d"`). The time is UTC (Python's is the machine's local time: the same on a machine
//! whose time zone is UTC). The directives are C's, as Python passes them to the C library in
//! the "C" locale, with glibc's `-` flag (no padding: `%-d`); any other is an error naming it.

use minijinja::{Error, ErrorKind};

const DAYS: [&str; 7] =
    ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// A moment broken down as `struct tm` has it.
struct Civil {
    year: i64,
    /// 1..=12
    month: u32,
    /// 1..=31
    day: u32,
    /// 1..=366
    yday: u32,
    /// 0 = Monday
    weekday: u32,
    hour: u32,
    minute: u32,
    second: u32,
}

/// `seconds` since the Unix epoch (UTC) broken down (Howard Hinnant's `civil_from_days`).
fn civil(seconds: i64) -> Civil {
    let (days, secs) = (seconds.div_euclid(86_400), seconds.rem_euclid(86_400) as u32);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let before = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334][month as usize - 1];
    let yday = before + day + u32::from(leap && month > 2);
    // 1970-01-01 was a Thursday (3 with Monday 0).
    let weekday = (days + 3).rem_euclid(7) as u32;
    Civil {
        year,
        month,
        day,
        yday,
        weekday,
        hour: secs / 3_600,
        minute: secs / 60 % 60,
        second: secs % 60,
    }
}

/// `format` with its directives replaced by the parts of `seconds` since the Unix epoch (UTC).
pub(super) fn format(format: &str, seconds: i64) -> Result<String, Error> {
    let t = civil(seconds);
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut directive = chars.next();
        let pad = directive != Some('-');
        if !pad {
            directive = chars.next();
        }
        let number = |out: &mut String, n: i64, width: usize| {
            if pad {
                out.push_str(&format!("{n:0width$}"));
            } else {
                out.push_str(&n.to_string());
            }
        };
        let hour12 = match t.hour % 12 {
            0 => 12,
            h => h,
        };
        match directive {
            Some('Y') => out.push_str(&t.year.to_string()),
            Some('y') => number(&mut out, t.year.rem_euclid(100), 2),
            Some('m') => number(&mut out, t.month.into(), 2),
            Some('d') => number(&mut out, t.day.into(), 2),
            Some('e') if pad => out.push_str(&format!("{:2}", t.day)),
            Some('e') => out.push_str(&t.day.to_string()),
            Some('j') => number(&mut out, t.yday.into(), 3),
            Some('H') => number(&mut out, t.hour.into(), 2),
            Some('I') => number(&mut out, hour12.into(), 2),
            Some('M') => number(&mut out, t.minute.into(), 2),
            Some('S') => number(&mut out, t.second.into(), 2),
            Some('f') => out.push_str("000000"),
            Some('p') => out.push_str(if t.hour < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(MONTHS[t.month as usize - 1]),
            Some('b') | Some('h') => out.push_str(&MONTHS[t.month as usize - 1][..3]),
            Some('A') => out.push_str(DAYS[t.weekday as usize]),
            Some('a') => out.push_str(&DAYS[t.weekday as usize][..3]),
            Some('w') => out.push_str(&((t.weekday + 1) % 7).to_string()),
            Some('u') => out.push_str(&(t.weekday + 1).to_string()),
            Some('F') => out.push_str(&format!("{}-{:02}-{:02}", t.year, t.month, t.day)),
            Some('T') | Some('X') => {
                out.push_str(&format!("{:02}:{:02}:{:02}", t.hour, t.minute, t.second))
            }
            Some('x') => {
                out.push_str(&format!("{:02}/{:02}/{:02}", t.month, t.day, t.year.rem_euclid(100)))
            }
            // A naive datetime (Python's `now()`) has no zone: `%z` and `%Z` are empty.
            Some('z') | Some('Z') => {}
            Some('%') => out.push('%'),
            other => {
                let shown = other.map_or("end of format".to_string(), |d| format!("%{d}"));
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now({format:?}): {shown} is not a directive Horizon formats \
                         (it knows %Y %y %m %d %e %j %H %I %M %S %f %p %B %b %h %A %a %w %u %F \
                         %T %X %x %z %Z %%, and the - flag)"
                    ),
                ));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Moments checked against Python's `datetime.utcfromtimestamp(s).strftime(...)`.
    #[test]
    fn formats_as_python() {
        let f = |fmt: &str, s: i64| format(fmt, s).unwrap();
        // 2025-08-05 17:04:09 UTC, a Tuesday.
        let t = 1_754_413_449;
        assert_eq!(f("%Y-%m-%d", t), "2025-08-05");
        assert_eq!(f("%d %b %Y", t), "05 Aug 2025");
        assert_eq!(
            f("%A %B %-d, %y %I:%M:%S %p %j %w %%", t),
            "Tuesday August 5, 25 05:04:09 PM 217 2 %"
        );
        assert_eq!(f("%e|%-e|%F %T|%x", t), " 5|5|2025-08-05 17:04:09|08/05/25");
        // The epoch, a leap day, the last day of a leap year, a date before the epoch.
        assert_eq!(f("%Y-%m-%d %H:%M:%S %a %j", 0), "1970-01-01 00:00:00 Thu 001");
        assert_eq!(f("%Y-%m-%d %a %j", 951_782_400), "2000-02-29 Tue 060");
        assert_eq!(f("%Y-%m-%d %j", 1_735_603_200), "2024-12-31 366");
        assert_eq!(f("%Y-%m-%d %H:%M %a", -1), "1969-12-31 23:59 Wed");
    }

    #[test]
    fn an_unknown_directive_is_an_error_naming_it() {
        let err = format("%Q %Y", 0).unwrap_err().to_string();
        assert!(err.contains("%Q"), "{err}");
        let err = format("100%", 0).unwrap_err().to_string();
        assert!(err.contains("end of format"), "{err}");
    }
}
