//! Accounts by name: the owner and group of a file fort writes for another service (a
//! delivered credential, a backup repository a server account writes into).

use std::ffi::CString;

/// Looks a user or group up through NSS (so systemd's dynamic users and directory
/// services count), or takes a numeric id as is.
#[allow(unsafe_code)]
pub fn account_id(name: &str, group: bool) -> Result<u32, String> {
    if let Ok(id) = name.parse::<u32>() {
        // (uid_t)-1 means "leave unchanged" to chown: never a real owner.
        if id == u32::MAX {
            return Err(format!("{name} is not a usable id"));
        }
        return Ok(id);
    }
    let what = if group { "group" } else { "user" };
    let cname = CString::new(name).map_err(|_| format!("{what} {name:?} is not a name"))?;
    let mut buf = vec![0u8; 4096];
    loop {
        let mut result: *mut libc::c_void = std::ptr::null_mut();
        // SAFETY: getpwnam_r/getgrnam_r write only into `entry` and `buf`, whose sizes are
        // passed; `result` points at `entry` or is null. Strings inside are not read.
        let (rc, id) = unsafe {
            if group {
                let mut entry: libc::group = std::mem::zeroed();
                let rc = libc::getgrnam_r(
                    cname.as_ptr(),
                    &mut entry,
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    (&mut result as *mut *mut libc::c_void).cast(),
                );
                (rc, entry.gr_gid)
            } else {
                let mut entry: libc::passwd = std::mem::zeroed();
                let rc = libc::getpwnam_r(
                    cname.as_ptr(),
                    &mut entry,
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    (&mut result as *mut *mut libc::c_void).cast(),
                );
                (rc, entry.pw_uid)
            }
        };
        if rc == libc::ERANGE && buf.len() < 1 << 20 {
            buf.resize(buf.len() * 4, 0);
            continue;
        }
        if rc != 0 {
            return Err(format!(
                "cannot look up {what} {name}: {}",
                std::io::Error::from_raw_os_error(rc)
            ));
        }
        if result.is_null() {
            return Err(format!("{what} {name} does not exist (yet)"));
        }
        return Ok(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numeric_ids_and_names() {
        assert!(account_id("4294967295", false).is_err());
        assert_eq!(account_id("0", false), Ok(0));
        assert_eq!(account_id("root", false), Ok(0));
        assert!(account_id("no-such-user-fort", false).is_err());
        assert!(account_id("a\0b", true).is_err());
    }
}
