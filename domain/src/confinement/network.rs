//! Which addresses a tenant's probe may reach by default: public unicast ones only.
//!
//! Verification sends requests to URLs a tenant's records name (health URLs, smoke checks).
//! Without a rule, those requests reach whatever Ferry can reach: its own port on loopback,
//! the cloud's metadata service (link-local), the operator's private network. So an
//! address is probed only when it is globally routable unicast; every special-purpose
//! range is refused, and the IPv6 forms that carry an IPv4 address (mapped, compatible,
//! NAT64) are judged by the address they carry. An operator may allow a literal address
//! explicitly by naming it in a probe URL prefix (see
//! [`Confinement::check_probe`](super::Confinement::check_probe)).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Whether a probe may connect to `ip` without the operator allowing it: a public unicast
/// address, not loopback, private, link-local, shared (CGNAT), unspecified, multicast,
/// broadcast, documentation, benchmarking or reserved.
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_public_v4(v4),
        IpAddr::V6(v6) => is_public_v6(v6),
    }
}

fn is_public_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    let special = a == 0 // "this network", unspecified
        || a == 10 // private
        || a == 127 // loopback
        || (a == 100 && (64..128).contains(&b)) // shared address space (CGNAT)
        || (a == 169 && b == 254) // link-local, cloud metadata services
        || (a == 172 && (16..32).contains(&b)) // private
        || (a == 192 && b == 0 && c == 0) // IETF protocol assignments
        || (a == 192 && b == 0 && c == 2) // documentation
        || (a == 192 && b == 88 && c == 99) // 6to4 relay anycast
        || (a == 192 && b == 168) // private
        || (a == 198 && (b == 18 || b == 19)) // benchmarking
        || (a == 198 && b == 51 && c == 100) // documentation
        || (a == 203 && b == 0 && c == 113) // documentation
        || a >= 224; // multicast, reserved, broadcast
    !special
}

fn is_public_v6(ip: Ipv6Addr) -> bool {
    let s = ip.segments();
    // Forms that carry an IPv4 address: judged by it (`::ffff:127.0.0.1` is loopback).
    if let Some(v4) = ip.to_ipv4_mapped() {
        return is_public_v4(v4);
    }
    if s[..6] == [0, 0, 0, 0, 0, 0] {
        // `::`, `::1` and the deprecated IPv4-compatible `::a.b.c.d`: none is probed.
        return false;
    }
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        // NAT64's well-known prefix: the gateway connects to the IPv4 address it carries.
        let [a, b] = s[6].to_be_bytes();
        let [c, d] = s[7].to_be_bytes();
        return is_public_v4(Ipv4Addr::new(a, b, c, d));
    }
    // Only global unicast (2000::/3), less its special-purpose blocks: Teredo and the
    // other IETF assignments (2001::/23), documentation (2001:db8::/32) and 6to4
    // (2002::/16, which tunnels to an IPv4 address of the sender's choosing).
    let global_unicast = s[0] & 0xe000 == 0x2000;
    let ietf = s[0] == 0x2001 && s[1] < 0x0200;
    let documentation = s[0] == 0x2001 && s[1] == 0x0db8;
    let six_to_four = s[0] == 0x2002;
    global_unicast && !ietf && !documentation && !six_to_four
}

#[cfg(test)]
mod tests {
    use super::*;

    fn public(text: &str) -> bool {
        is_public(text.parse().unwrap_or_else(|e| panic!("{text}: {e}")))
    }

    #[test]
    fn only_public_unicast_addresses_are_probed_by_default() {
        for internal in [
            "127.0.0.1",
            "127.255.255.254",
            "0.0.0.0",
            "0.1.2.3",
            "10.0.0.1",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "100.127.255.255",
            "192.0.0.170",
            "192.0.2.1",
            "198.18.0.1",
            "198.51.100.7",
            "203.0.113.9",
            "224.0.0.1",
            "239.255.255.250",
            "240.0.0.1",
            "255.255.255.255",
            "::",
            "::1",
            "::127.0.0.1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "::ffff:10.1.2.3",
            "64:ff9b::7f00:1",
            "64:ff9b::a9fe:a9fe",
            "64:ff9b:1::1",
            "fc00::1",
            "fd12:3456::1",
            "fe80::1",
            "fec0::1",
            "ff02::1",
            "100::1",
            "2001::1",
            "2001:db8::1",
            "2002:7f00:1::1",
        ] {
            assert!(
                !public(internal),
                "{internal} must not be probed by default"
            );
        }
        for external in [
            "8.8.8.8",
            "1.1.1.1",
            "100.63.255.255",
            "100.128.0.1",
            "172.15.255.255",
            "172.32.0.1",
            "192.169.0.1",
            "169.253.0.1",
            "223.255.255.255",
            "::ffff:8.8.8.8",
            "64:ff9b::808:808",
            "2001:4860:4860::8888",
            "2606:4700:4700::1111",
        ] {
            assert!(public(external), "{external} is public");
        }
    }
}
