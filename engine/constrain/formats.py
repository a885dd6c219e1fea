"""The string formats the compiler enforces, each as a pattern over regex.py (with a length bound).

Each pattern is a subset of its format, chosen so that what the model writes is valid for the
format's RFC and for the readers clients use (Python's datetime, uuid and ipaddress, pydantic):
years 0001-9999 with the days each month has (29 February in leap years only), seconds 00-59
(no leap second), at most 6 fraction digits, `T` and `Z` upper case; durations of at most
6 digits a unit; e-mail addresses of dot-atoms (RFC 5321) at a host name; URIs with a scheme
and a `//` authority of a host name (RFC 3986), a port under 10000; IPv6 addresses of hex groups (no embedded IPv4, no zone).

Next: regex.py, which compiles them; schema.py reads `format`.
"""

from __future__ import annotations

_YEAR = r"(?:[1-9]\d{3}|0[1-9]\d\d|00[1-9]\d|000[1-9])"
_LEAP_YEAR = r"(?:\d\d(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (r"(?:" + _YEAR + r"-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\d|3[01])|(?:0[469]|11)-(?:0[1-9]|[12]\d|30)"
         r"|02-(?:0[1-9]|1\d|2[0-8]))|" + _LEAP_YEAR + r"-02-29)")
_TIME = r"(?:[01]\d|2[0-3]):[0-5]\d:[0-5]\d(?:\.\d{1,6})?(?:Z|[+-](?:[01]\d|2[0-3]):[0-5]\d)"
_N = r"\d{1,6}"  # a number of a unit: more would overflow the readers' durations
_DURATION_TIME = rf"T(?:{_N}H(?:{_N}M(?:{_N}S)?)?|{_N}M(?:{_N}S)?|{_N}S)"
_DURATION = (rf"P(?:(?:{_N}Y(?:{_N}M(?:{_N}D)?)?|{_N}M(?:{_N}D)?|{_N}D)(?:{_DURATION_TIME})?"
             rf"|{_DURATION_TIME}|{_N}W)")
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = rf"{_LABEL}(?:\.{_LABEL})*"
_ATOM = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
_EMAIL = rf"{_ATOM}(?:\.{_ATOM})*@{_LABEL}(?:\.{_LABEL})+"
_URI_CHARS = r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@]|%[0-9A-Fa-f]{2})"
_URI = (rf"[A-Za-z][A-Za-z0-9+.\-]*://(?:{_URI_CHARS.replace(':@', ':')}*@)?{_HOSTNAME}(?::[1-9]\d{{0,3}})?"
        rf"(?:/{_URI_CHARS}*)*(?:\?(?:{_URI_CHARS}|[/?])*)?(?:#(?:{_URI_CHARS}|[/?])*)?")
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4 = rf"{_OCTET}(?:\.{_OCTET}){{3}}"
_H16 = r"[0-9A-Fa-f]{1,4}"
_IPV6 = "|".join([rf"(?:{_H16}:){{7}}{_H16}"]
                 + [rf"(?:(?:{_H16}:){{0,{k}}}{_H16})?::(?:{_H16}:){{0,{5 - k}}}{_H16}" for k in range(6)]
                 + [rf"(?:(?:{_H16}:){{0,6}}{_H16})?::"])

# format -> (pattern matched whole, most characters: None for no bound of the format's own)
FORMATS = {
    "date-time": (rf"{_DATE}T{_TIME}", None),
    "date": (_DATE, None),
    "time": (_TIME, None),
    "duration": (_DURATION, None),
    "email": (_EMAIL, 254),     # RFC 5321's bound on a path
    "uuid": (r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}", None),
    "uri": (_URI, None),
    "ipv4": (_IPV4, None),
    "ipv6": (rf"(?:{_IPV6})", None),
    "hostname": (_HOSTNAME, 253),  # RFC 1123's bound on a name
}
