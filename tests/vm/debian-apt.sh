# shellcheck shell=bash
# debian-apt.sh - apt-get on a private state dir, for scripts that fetch Debian packages to
# UNPACK for the test VM (get-bpo-kernel.sh, get-trixie-tls.sh), never to install: the
# system's apt sources, lists and package database stay as they are. Sourced, not run.
#
#   debian_mirror            the Debian mirror of the system's bookworm sources (not the
#                            security one; $BPO_MIRROR overrides), on stdout
#   apt_private DIR SUITE    sets APTO (apt-get/apt-cache options) for lists, cache, sources
#                            and an empty dpkg status under DIR, with SUITE of that mirror,
#                            checked against debian-archive-keyring; runs apt-get update.
#                            An empty status makes apt fetch a package's whole dependency
#                            closure (libc6 included), which is what an unpacked root needs.

debian_mirror() {
  local f
  # deb822 stanzas: URIs of a stanza whose Suites has bookworm, bookworm-updates or -backports
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -r "$f" ] || continue
    awk 'function flush() { if (uri != "" && suites ~ /(^| )bookworm(-updates|-backports)?( |$)/ && types ~ /(^| )deb( |$)/) { print uri; found = 1; exit } uri = suites = types = "" }
         /^[ \t]*$/ { flush(); next }
         /^URIs:/   { uri = $2 }
         /^Suites:/ { $1 = ""; suites = $0 " " }
         /^Types:/  { $1 = ""; types = $0 " " }
         END { if (!found) flush() }' "$f"
  done
  # one-line format: deb [options] URI SUITE COMPONENTS...
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -r "$f" ] || continue
    sed -e 's/#.*//' -e 's/\[[^]]*\]//' "$f" |
      awk '$1 == "deb" && $3 ~ /^bookworm(-updates|-backports)?$/ {print $2}'
  done
}

apt_private() { # DIR SUITE
  local a=$1 suite=$2 uri keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  uri=${BPO_MIRROR:-$(debian_mirror | head -n 1)}
  [ -n "$uri" ] || { echo "no Debian bookworm mirror in /etc/apt/sources.list{,.d/*.sources,.d/*.list} (set BPO_MIRROR)" >&2; return 1; }
  echo "apt: mirror $uri, suite $suite, state in $a" >&2
  rm -rf "$a"
  mkdir -p "$a/lists/partial" "$a/cache/archives/partial" "$a/parts" "$a/pkgs" || return 1
  : > "$a/status"
  if [ -r $keyring ]; then echo "deb [signed-by=$keyring] $uri $suite main" > "$a/sources.list"
  else echo "deb $uri $suite main" > "$a/sources.list"; fi
  APTO=(-o "Dir::Etc::SourceList=$a/sources.list" -o "Dir::Etc::SourceParts=$a/parts"
        -o "Dir::State::Lists=$a/lists" -o "Dir::Cache=$a/cache" -o "Dir::State::status=$a/status"
        -o APT::Sandbox::User=root -o Acquire::Retries=3 -o Acquire::Languages=none)
  apt-get -q "${APTO[@]}" update >&2 || { echo "apt-get update of $suite failed" >&2; return 1; }
}
