#!/usr/bin/env bash
# The host side of the kubelet's restart, run as systemd would run it (called by
# scripts/check-ship.sh; runs alone too, as root, in a few seconds, touching nothing of the
# host: everything happens in a mount namespace of its own).
#
# systemd/kubelet-ca-agent-kubelet-restart.service runs as root with systemd's bus, in a
# directory that the agent, which may have been taken over, can fill with anything. This
# takes the service's ExecStart= and ExecStopPost= command lines from the unit file, parses
# them as systemd does (quotes, C escapes, %% and $$; anything else it cannot vouch for
# fails the check), and runs them in order, exactly as written, with:
#   - a stand-in for systemctl bound over the real one, succeeding or failing on demand;
#   - the request directory a fresh writable directory bound at its real path;
#   - the rest of the file system read-only, as ProtectSystem=strict leaves it to the
#     service; /run a writable tmpfs, holding files that a planted link points to, so that
#     a step that followed a link would be seen writing there, read-only root or not.
# It checks the protocol (request renamed to taken, systemctl restart kubelet.service,
# result "success exited 0" or "exit-code exited 1", written by rename), that links and
# hard links planted as request, taken, result and result.tmp are never written through,
# and that a result.tmp planted between the removal and the write (a race the agent could
# win) is refused rather than followed (a stand-in rm that removes nothing plays it).
# Then kubelet-ca-agent.tmpfiles, applied with systemd-tmpfiles --root, must make the
# directory root's, 0700.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
unit=systemd/kubelet-ca-agent-kubelet-restart.service
dir=/run/kubelet-ca-agent/kubelet-restart

if [ "${1:-}" != --inside ]; then
  [ "$(id -u)" -eq 0 ] || { echo "check-restart-unit.sh: needs root (a mount namespace and bind mounts)" >&2; exit 1; }
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  # Private propagation: no mount made inside reaches the host.
  unshare --mount --propagation private "$0" --inside "$work"
  # The tmpfiles.d snippet: the directory, root's alone.
  systemd-tmpfiles --root="$work/tmpfiles" --create "$repo/systemd/kubelet-ca-agent.tmpfiles"
  got=$(stat -c '%a %U %G' "$work/tmpfiles$dir")
  [ "$got" = "700 root root" ] || { echo "kubelet-ca-agent.tmpfiles made $dir $got, not 700 root root" >&2; exit 1; }
  echo "kubelet-ca-agent.tmpfiles: $dir is 700 root root"
  exit 0
fi

# --- inside the mount namespace ---------------------------------------------------------
work=$2
fail() { echo "check-restart-unit.sh: $*" >&2; exit 1; }

# The command lines, as systemd parses them (systemd.service(5), "Command lines"; specifiers
# and environment variables at exec time as systemd.unit(5) and systemd.service(5) say).
mkdir -p "$work/commands"
python3 - "$unit" "$work/commands" <<'PY'
import sys

ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
           "\\": "\\", '"': '"', "'": "'", " ": " "}

def words(line):
    out, i, n = [], 0, len(line)
    while True:
        while i < n and line[i] in " \t":
            i += 1
        if i >= n:
            return out
        word, quote = [], None
        while i < n:
            c = line[i]
            if c == "\\":
                if i + 1 >= n or line[i + 1] not in ESCAPES:
                    sys.exit(f"{line!r}: an escape this check does not parse as systemd does")
                word.append(ESCAPES[line[i + 1]])
                i += 2
                continue
            if quote:
                if c == quote:
                    quote = None
                else:
                    word.append(c)
            elif c in "'\"":
                quote = c
            elif c in " \t":
                break
            else:
                word.append(c)
            i += 1
        if quote:
            sys.exit(f"{line!r}: unterminated quote")
        out.append("".join(word))

def resolve(word, line):
    # Specifiers at load time: only %% (a literal %); variables at exec time: only $$ (a
    # literal $). Anything else would be systemd's to fill in, which this check cannot.
    out, i = [], 0
    while i < len(word):
        c = word[i]
        if c in "%$":
            if word[i + 1 : i + 2] != c:
                sys.exit(f"{line!r}: {word[i:i+2]!r} is expanded by systemd; only {c}{c} is checked")
            out.append(c)
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out)

section, count = None, 0
for raw in open(sys.argv[1]):
    line = raw.strip()
    if line.startswith("["):
        section = line
        continue
    if section != "[Service]" or not line.startswith(("ExecStart=", "ExecStopPost=")):
        continue
    if line.endswith("\\"):
        sys.exit(f"{line!r}: continued lines are not parsed here")
    key, value = line.split("=", 1)
    argv = [resolve(w, line) for w in words(value)]
    if not argv or not argv[0].startswith("/"):
        sys.exit(f"{line!r}: the program must be an absolute path without a prefix (-, @, +, !)")
    # One file per command line, in order, its words NUL-terminated.
    count += 1
    with open(f"{sys.argv[2]}/{count:02d}-{key}", "w") as out:
        out.write("".join(w + "\0" for w in argv))
PY
ls "$work/commands" | grep -q -- '-ExecStart$' && ls "$work/commands" | grep -q -- '-ExecStopPost$' ||
  fail "$unit has no ExecStart= or no ExecStopPost="

# The service's view: / read-only (a bind of the root mount, remounted read-only in this
# namespace only), /run a writable tmpfs, the request directory writable, systemctl the
# stand-in.
root=$work/root
mkdir -p "$root" "$work/dir" "$work/bin"
mount --bind / "$root"
mount -o remount,bind,ro "$root"
[ -w / ] || fail "the host's / became read-only"
mount --rbind /dev "$root/dev"
mount -t tmpfs -o mode=0755 tmpfs "$root/run"
mkdir -p "$root$dir" "$root/run/victims" "$root/run/check"
mount --bind "$work/dir" "$root$dir"
cat > "$work/bin/systemctl" <<'EOF'
#!/bin/sh
echo "$*" >> /run/check/systemctl.log
exit "$(cat /run/check/systemctl.exit)"
EOF
chmod 0755 "$work/bin/systemctl"
systemctl=$(readlink -f /bin/systemctl) || fail "no /bin/systemctl to stand in for"
mount --bind "$work/bin/systemctl" "$root$systemctl"
# The stand-in rm for the race: it removes nothing, as if the agent had planted result.tmp
# again right after the removal.
mkdir -p "$root/run/racebin"
printf '#!/bin/sh\nexit 0\n' > "$root/run/racebin/rm"
chmod 0755 "$root/run/racebin/rm"
touch "$root/etc/kubelet-ca-agent-check" 2>/dev/null && fail "the service's root is writable"

D=$work/dir            # the request directory, from here
V=$root/run/victims    # what planted links point to
systemd_path=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# One run of the service, as systemd does it: the ExecStart= lines in order until one fails,
# then ExecStopPost= with SERVICE_RESULT, EXIT_CODE and EXIT_STATUS.
run_service() {
  local path=${1:-$systemd_path} command status=0 result=success
  local -a argv
  for command in "$work/commands/"*-ExecStart; do
    mapfile -d '' -t argv < "$command"
    chroot "$root" env -i PATH="$path" "${argv[@]}" >> "$work/out" 2>&1 || {
      status=$?; result=exit-code; break; }
  done
  for command in "$work/commands/"*-ExecStopPost; do
    mapfile -d '' -t argv < "$command"
    chroot "$root" env -i PATH="$path" SERVICE_RESULT=$result EXIT_CODE=exited EXIT_STATUS=$status \
      "${argv[@]}" >> "$work/out" 2>&1 || true
  done
}

# The agent's side of the protocol: remove the result, write the request by rename.
ask() {
  rm -f "$D/result"
  echo "restart kubelet.service" > "$D/.request.1"
  mv "$D/.request.1" "$D/request"
}

reset() {
  rm -rf "${D:?}"/* "${D:?}"/.[!.]* "${V:?}"/* "$root/run/check/"*
  echo keep > "$V/file"
  # A file outside the directory on its file system and mount, for hard links.
  echo keep > "$work/dir-victim"
  echo 0 > "$root/run/check/systemctl.exit"
}

expect_result() {
  [ -f "$D/result" ] && [ ! -L "$D/result" ] || fail "$1: no regular file result ($(ls -la "$D"))"
  [ "$(cat "$D/result")" = "$2" ] || fail "$1: result is '$(cat "$D/result")', expected '$2'"
  [ ! -e "$D/result.tmp" ] || fail "$1: result.tmp was left behind"
}

untouched() {
  [ "$(cat "$V/file")" = keep ] || fail "$1: a file outside the directory was written through a link"
  [ "$(cat "$work/dir-victim")" = keep ] || fail "$1: a file outside the directory was written through a hard link"
  [ "$(ls "$V")" = file ] || fail "$1: a file was created outside the directory: $(ls "$V")"
  [ ! -e "$root/etc/kubelet-ca-agent-check" ] || fail "$1: a file was created on the read-only root"
}

# 1. A request, and systemctl succeeds.
reset; ask
run_service
[ ! -e "$D/request" ] || fail "success: the request was not taken"
[ "$(cat "$D/taken")" = "restart kubelet.service" ] || fail "success: taken is not the request"
[ "$(cat "$root/run/check/systemctl.log")" = "--no-ask-password restart kubelet.service" ] ||
  fail "success: systemctl was called as '$(cat "$root/run/check/systemctl.log")'"
expect_result success "success exited 0"
echo "a request: taken, systemctl restart kubelet.service, result 'success exited 0'"

# 2. systemctl fails (the kubelet did not start).
reset; ask; echo 1 > "$root/run/check/systemctl.exit"
run_service
expect_result failure "exit-code exited 1"
echo "a failed restart: result 'exit-code exited 1'"

# 3. No request (started by hand): no restart, a failed result.
reset
run_service
[ ! -e "$root/run/check/systemctl.log" ] || fail "no request: systemctl ran all the same"
expect_result "no request" "exit-code exited 1"
echo "no request: no restart, result 'exit-code exited 1'"

# 4. Links planted by the agent: request, taken and result linking out of the directory,
#    result.tmp to a file outside, then to a file that does not exist (a link that would
#    create it); and result.tmp as a hard link to a file outside.
for plant in links dangling hardlink; do
  reset
  case $plant in
    links)
      ln -s /run/victims/file "$D/request"
      ln -s /run/victims/file "$D/taken"
      ln -s /run/victims/file "$D/result"
      ln -s /run/victims/file "$D/result.tmp";;
    dangling)
      ask
      ln -s /run/victims/new "$D/taken"
      ln -s /run/victims/new "$D/result"
      ln -s /run/victims/new "$D/result.tmp";;
    hardlink)
      ask
      ln "$work/dir-victim" "$D/result.tmp";;
  esac
  run_service
  untouched "$plant"
  expect_result "$plant" "success exited 0"
  if [ "$plant" = links ]; then
    [ "$(readlink "$D/taken")" = /run/victims/file ] || fail "links: the request link was not moved to taken as a link"
  fi
  echo "planted $plant: nothing outside written, result 'success exited 0'"
done

# 5. The race: result.tmp is there again when the write comes (the stand-in rm removes
#    nothing). noclobber must refuse every kind; no result is written.
for plant in link dangling-link readonly-link hardlink file; do
  reset; ask
  case $plant in
    link) ln -s /run/victims/file "$D/result.tmp";;
    dangling-link) ln -s /run/victims/new "$D/result.tmp";;
    readonly-link) ln -s /etc/kubelet-ca-agent-check "$D/result.tmp";;
    hardlink) ln "$work/dir-victim" "$D/result.tmp";;
    file) echo planted > "$D/result.tmp";;
  esac
  run_service "/run/racebin:$systemd_path"
  untouched "race with $plant"
  [ ! -e "$D/result" ] || fail "race with $plant: a result was written through the planted result.tmp"
  echo "race, result.tmp a $plant: refused, nothing written"
done
