#!/usr/bin/env bash
# The shipped units under a real systemd (called by scripts/check-ship.sh; runs alone too).
#
# systemd-analyze reads a unit; only systemd running it shows what its sandbox hides, what
# its IP filter drops, and that the path unit and the restart service work together. This
# boots systemd as PID 1 in namespaces of its own (PID, mount, network, UTS, IPC, cgroup)
# on an overlay of / whose writes all go to a tmpfs, so nothing it does reaches the host's
# files, network or processes; it is killed at the end. Then, with a stand-in kubelet:
#   - the kubelet's restart: a request taken, the kubelet restarted, the result
#     ("success ...", "exit-code ..."), a request during a restart making one more, links
#     planted by the agent never written through;
#   - kubelet-ca-agent.service as shipped, with ip-allow.conf, a probe run inside its
#     sandbox (ExecStartPre=): what it may read, write and connect to (the control plane's
#     secrets, systemd's bus, a runtime's socket, an address not allowed: never); then with
#     cloud-ca.conf;
#   - with --binary PATH (a kubelet-ca-agent build), the agent itself in the unit: it keeps
#     a kubeconfig from a dir: source, a CA added makes the host restart the kubelet, and its
#     own confinement (Landlock, seccomp) is not refused by the unit.
# Needs root, overlayfs and cgroup2, on a machine whose PID 1 is not systemd (a container or
# a VM without it: a systemd host would need a delegated cgroup); elsewhere it says why and
# skips (exit 0), unless LIVE_REQUIRED=1.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
binary=
[ "${1:-}" = --binary ] && binary=$(realpath "$2")

skip() {
  echo "check-units-live.sh: skipped: $*"
  [ "${LIVE_REQUIRED:-}" = 1 ] && exit 1
  exit 0
}
[ "$(id -u)" -eq 0 ] || skip "needs root"
[ "$(cat /proc/1/comm)" != systemd ] || skip "PID 1 is systemd here (a nested one needs a delegated cgroup)"
grep -qw overlay /proc/filesystems || skip "no overlayfs"
cgroot=$(findmnt -n -t cgroup2 -o TARGET | head -n 1)
[ -n "$cgroot" ] || skip "no cgroup2 mount"
unshare --mount --propagation private sh -c 'mount -t tmpfs none /mnt' 2>/dev/null || skip "cannot mount in a new mount namespace"
[ -x /lib/systemd/systemd ] || skip "no /lib/systemd/systemd"
for tool in ip python3 openssl curl nsenter findmnt mountpoint; do
  command -v "$tool" >/dev/null || skip "no $tool"
done

work=$(mktemp -d /tmp/kca-live.XXXXXX)
cg="$cgroot/kca-live-$$"
nspid=
cleanup() {
  [ -n "$nspid" ] && kill -KILL "$nspid" 2>/dev/null || true
  sleep 0.5
  [ -d "$cg" ] && find "$cg" -depth -type d -exec rmdir {} \; 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
fail() {
  echo "check-units-live.sh: $*" >&2
  inside journalctl --no-pager -n 60 -o short-monotonic >&2 2>/dev/null || true
  exit 1
}

# --- what goes in: the repository's units, the stand-ins, the probe ----------------------
share=$work/share
mkdir -p "$share/units/kubelet-ca-agent.service.d" "$work/root" "$work/ovl"
cp systemd/kubelet-ca-agent.service systemd/kubelet-ca-agent-kubelet-restart.path \
  systemd/kubelet-ca-agent-kubelet-restart.service "$share/units/"
cp systemd/kubelet-ca-agent.tmpfiles systemd/kubelet-ca-agent.sysconfig "$share/"
sed 's/^IPAddressAllow=192.0.2.10$/IPAddressAllow=10.99.0.1/' systemd/kubelet-ca-agent.service.d/ip-allow.conf \
  > "$share/units/kubelet-ca-agent.service.d/ip-allow.conf"
grep -q '^IPAddressAllow=10.99.0.1$' "$share/units/kubelet-ca-agent.service.d/ip-allow.conf" ||
  fail "ip-allow.conf has no IPAddressAllow=192.0.2.10 line to point at the test's API server"
cp systemd/kubelet-ca-agent.service.d/cloud-ca.conf "$share/"
[ -n "$binary" ] && cp "$binary" "$share/kubelet-ca-agent"
cat > "$share/units/kubelet.service" <<'EOF'
[Unit]
Description=kubelet stand-in
# As kubeadm's kubelet.service: restarts are never refused for coming too often.
StartLimitIntervalSec=0
[Service]
ExecStartPre=/bin/sh -c 'date +%%s.%%N >> /kcashare/kubelet-starts; sleep "$(cat /kcashare/kubelet-delay 2>/dev/null || echo 0)"; test ! -e /kcashare/kubelet-fail'
ExecStart=/bin/sleep infinity
EOF
cat > "$share/units/kca-live.target" <<'EOF'
[Unit]
Description=check-units-live
Wants=basic.target
After=basic.target
EOF
cat > "$share/probe.sh" <<'EOF'
#!/bin/bash
# Run inside kubelet-ca-agent.service's sandbox: one line per attempt, ALLOWED or denied.
try() { local what=$1; shift; if out=$("$@" 2>&1); then echo "PROBE $what: ALLOWED"; else echo "PROBE $what: denied (${out:0:100})"; fi; }
connect() { python3 -c '
import socket, sys
target = sys.argv[1]
try:
    if target.startswith("/"):
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM if target.endswith("notify") else socket.SOCK_STREAM).connect(target)
    else:
        socket.create_connection((target, 6443), timeout=3)
except OSError as e:
    sys.exit(str(e) or type(e).__name__)' "$1"; }
try "read /etc/kubernetes/pki/ca.key" cat /etc/kubernetes/pki/ca.key
try "read /etc/kubernetes/admin.conf" cat /etc/kubernetes/admin.conf
try "read /etc/kubernetes/super-admin.conf" cat /etc/kubernetes/super-admin.conf
try "list /etc/kubernetes/manifests" ls /etc/kubernetes/manifests
try "create /etc/kubernetes/manifests/evil.yaml" touch /etc/kubernetes/manifests/evil.yaml
try "read a static pod secret" cat /etc/kubernetes/static-pod-resources/kube-apiserver-pod-3/secrets/etcd-client/tls.key
try "read the cloud CA" cat /etc/kubernetes/static-pod-resources/configmaps/cloud-config/ca-bundle.pem
try "write the cloud CA's directory" sh -c 'echo x > /etc/kubernetes/static-pod-resources/configmaps/cloud-config/.probe && rm /etc/kubernetes/static-pod-resources/configmaps/cloud-config/.probe'
try "list /var/lib/etcd" ls /var/lib/etcd
try "read a pod's token" cat /var/lib/kubelet/pods/p1/token
try "read /var/lib/kubelet/pki" ls /var/lib/kubelet/pki
try "read /var/lib/kubelet/config.yaml" cat /var/lib/kubelet/config.yaml
try "write in /var/lib/kubelet" sh -c 'echo x > /var/lib/kubelet/.probe && rm /var/lib/kubelet/.probe'
try "write /var/lib/kubelet/config.yaml" sh -c 'echo x >> /var/lib/kubelet/config.yaml'
try "write in /var/lib/kubelet/pki" sh -c 'echo x > /var/lib/kubelet/pki/.probe && rm /var/lib/kubelet/pki/.probe'
try "create /etc/cron.d/evil" touch /etc/cron.d/evil
try "create /etc/systemd/system/evil.service" touch /etc/systemd/system/evil.service
try "replace admin.conf by rename" sh -c 'echo x > /etc/kubernetes/.a && mv -f /etc/kubernetes/.a /etc/kubernetes/admin.conf; r=$?; rm -f /etc/kubernetes/.a; exit $r'
try "write in /etc/kubernetes" sh -c 'echo x > /etc/kubernetes/.probe && rm /etc/kubernetes/.probe'
try "write in the restart directory" sh -c 'echo x > /run/kubelet-ca-agent/kubelet-restart/.probe && rm /run/kubelet-ca-agent/kubelet-restart/.probe'
try "write in the state directory" sh -c 'echo x > /var/lib/kubelet-ca-agent/.probe && rm /var/lib/kubelet-ca-agent/.probe'
try "connect /run/dbus/system_bus_socket" connect /run/dbus/system_bus_socket
try "connect /run/systemd/private" connect /run/systemd/private
try "connect /run/containerd/containerd.sock" connect /run/containerd/containerd.sock
try "connect /run/systemd/notify" connect /run/systemd/notify
try "connect 127.0.0.1:6443" connect 127.0.0.1
try "connect 10.99.0.1:6443 (allowed)" connect 10.99.0.1
try "connect 10.99.0.9:6443 (not allowed)" connect 10.99.0.9
try "systemctl restart kubelet" systemctl --no-block restart kubelet.service
exit 0
EOF
chmod 0755 "$share/probe.sh"

# --- PID 1 ----------------------------------------------------------------------------------
cat > "$work/init.sh" <<'EOF'
#!/bin/bash
# PID 1 of the new namespaces, until it becomes systemd. Every write below lands in the
# overlay's tmpfs or in $W/share; the overlay is checked to be mounted before anything
# else is touched.
set -euo pipefail
W=$1 R=$1/root
mount -t tmpfs tmpfs "$W/ovl"
mkdir "$W/ovl/upper" "$W/ovl/work"
mount -t overlay overlay -o "lowerdir=/,upperdir=$W/ovl/upper,workdir=$W/ovl/work" "$R"
mountpoint -q "$R" && [ "$(findmnt -n -o FSTYPE "$R")" = overlay ] || exit 1
mount -t proc proc "$R/proc"
mount -t sysfs sysfs "$R/sys"
mount -t cgroup2 cgroup2 "$R/sys/fs/cgroup"
mount -t tmpfs -o mode=0755 tmpfs "$R/dev"
for n in null zero full random urandom tty; do touch "$R/dev/$n"; mount --bind "/dev/$n" "$R/dev/$n"; done
mkdir "$R/dev/pts" "$R/dev/shm"
mount -t devpts -o newinstance,ptmxmode=0666 devpts "$R/dev/pts"; ln -s pts/ptmx "$R/dev/ptmx"
mount -t tmpfs -o mode=0755 tmpfs "$R/run"
mount -t tmpfs -o mode=1777 tmpfs "$R/tmp"
mkdir -p "$R/kcashare"; mount --bind "$W/share" "$R/kcashare"
# A minimal boot: nothing the distribution wants at boot (no tmpfiles cleaning, sysctl,
# timers, services), only journald and what the test starts.
find "$R/etc/systemd/system" "$R/lib/systemd/system" "$R/usr/lib/systemd/system" -maxdepth 1 -name '*.wants' -exec rm -rf {} + 2>/dev/null || true
mkdir -p "$R/etc/systemd/system/sockets.target.wants"
for s in systemd-journald.socket systemd-journald-dev-log.socket; do
  ln -s "/lib/systemd/system/$s" "$R/etc/systemd/system/sockets.target.wants/$s"
done
cp -r "$W/share/units/." "$R/etc/systemd/system/"
ip link set lo up
for a in 10.99.0.1 10.99.0.9; do ip addr add "$a/32" dev lo; done
cd "$R"; mkdir -p oldroot; pivot_root . oldroot; umount -l /oldroot
export container=kca-live
exec /lib/systemd/systemd --unit=kca-live.target </dev/null >/kcashare/systemd.log 2>&1
EOF
chmod 0755 "$work/init.sh"

mkdir "$cg"
( echo "$BASHPID" > "$cg/cgroup.procs"
  exec unshare --pid --fork --mount --uts --ipc --net --cgroup --propagation private "$work/init.sh" "$work" \
    > "$share/launcher.log" 2>&1 ) &
launcher=$!
# The launcher became unshare; its one child is PID 1 of the namespaces, then systemd.
for _ in $(seq 50); do
  nspid=$(cat "/proc/$launcher/task/$launcher/children" 2>/dev/null | cut -d' ' -f1) || true
  [ -n "$nspid" ] && break
  sleep 0.2
done
[ -n "$nspid" ] || fail "systemd did not start: $(cat "$share/launcher.log" "$share/systemd.log" 2>/dev/null)"
inside() { nsenter -t "$nspid" -a "$@"; }
for _ in $(seq 50); do
  [ "$(inside systemctl is-system-running 2>/dev/null)" = running ] && break
  sleep 0.2
done
[ "$(inside systemctl is-system-running 2>/dev/null)" = running ] || fail "systemd is not running: $(inside systemctl is-system-running 2>&1)"
echo "systemd $(inside systemctl --version | head -n 1 | cut -d' ' -f2) runs as PID 1 in namespaces of its own, on an overlay of /"

# --- the kubelet's restart --------------------------------------------------------------------
inside bash -c 'set -e
cp /kcashare/kubelet-ca-agent.tmpfiles /etc/tmpfiles.d/kubelet-ca-agent.conf
systemd-tmpfiles --create /etc/tmpfiles.d/kubelet-ca-agent.conf
systemctl daemon-reload
systemctl enable --quiet --now kubelet-ca-agent-kubelet-restart.path
systemctl start kubelet.service'
D=/run/kubelet-ca-agent/kubelet-restart
[ "$(inside stat -c '%a %U' $D)" = "700 root" ] || fail "$D is not 700 root"
ask() { inside bash -c "rm -f $D/result; echo 'restart kubelet.service' > $D/.request.1; mv $D/.request.1 $D/request"; }
wait_result() {
  for _ in $(seq 100); do
    inside test -f $D/result && [ "$(inside systemctl is-active kubelet-ca-agent-kubelet-restart.service)" != activating ] && break
    sleep 0.1
  done
  inside cat $D/result 2>/dev/null || true
}
starts() { wc -l < "$share/kubelet-starts"; }

n=$(starts); ask
[ "$(wait_result)" = "success exited 0" ] || fail "restart: result '$(inside cat $D/result 2>&1)'"
[ "$(starts)" -eq $((n + 1)) ] || fail "restart: the kubelet was not restarted once"
inside test ! -e $D/request && inside test -f $D/taken || fail "restart: the request was not taken"
echo "restart: the request taken, the kubelet restarted, result 'success exited 0'"

touch "$share/kubelet-fail"; ask
[ "$(wait_result)" = "exit-code exited 1" ] || fail "failed restart: result '$(inside cat $D/result 2>&1)'"
rm "$share/kubelet-fail"; inside systemctl start kubelet.service
echo "a kubelet that does not start: result 'exit-code exited 1'"

echo 2 > "$share/kubelet-delay"; n=$(starts); ask
for _ in $(seq 50); do inside test ! -e $D/request && break; sleep 0.1; done
sleep 0.5
[ "$(inside systemctl is-active kubelet-ca-agent-kubelet-restart.service)" = activating ] ||
  fail "a request during a restart: the first restart is not running"
ask
for _ in $(seq 150); do [ "$(starts)" -ge $((n + 2)) ] && break; sleep 0.1; done
sleep 3
[ "$(wait_result)" = "success exited 0" ] || fail "a request during a restart: result '$(inside cat $D/result 2>&1)'"
[ "$(starts)" -eq $((n + 2)) ] || fail "a request during a restart: $(( $(starts) - n )) restarts, not 2"
rm "$share/kubelet-delay"
echo "a request during a restart: one more restart after it"

inside bash -c "set -e; echo keep > /etc/kca-victim
rm -f $D/taken $D/result $D/result.tmp
ln -s /etc/kca-victim $D/taken; ln -s /etc/kca-victim $D/result; ln -s /etc/kca-new $D/result.tmp"
ask
[ "$(wait_result)" = "success exited 0" ] || fail "planted links: result '$(inside cat $D/result 2>&1)'"
[ "$(inside cat /etc/kca-victim)" = keep ] && inside test ! -e /etc/kca-new || fail "planted links: written through"
echo "links planted as taken, result and result.tmp: nothing outside written"
sec=$(inside systemd-analyze security --no-pager kubelet-ca-agent-kubelet-restart.service | tail -n 1)
echo "systemd-analyze security (online) kubelet-ca-agent-kubelet-restart.service: ${sec#*: }"

# --- kubelet-ca-agent.service's sandbox -----------------------------------------------------
inside bash -c 'set -e
mkdir -p /etc/kubernetes/pki /etc/kubernetes/manifests /var/lib/etcd/member /var/lib/kubelet/pods/p1 \
  /var/lib/kubelet/pki /run/containerd /run/dbus \
  /etc/kubernetes/static-pod-resources/kube-apiserver-pod-3/secrets/etcd-client \
  /etc/kubernetes/static-pod-resources/configmaps/cloud-config
for f in /etc/kubernetes/pki/ca.key /etc/kubernetes/admin.conf /etc/kubernetes/super-admin.conf \
  /var/lib/etcd/member/db /var/lib/kubelet/pods/p1/token \
  /etc/kubernetes/static-pod-resources/kube-apiserver-pod-3/secrets/etcd-client/tls.key; do echo SECRET > $f; done
echo CA > /etc/kubernetes/static-pod-resources/configmaps/cloud-config/ca-bundle.pem
echo "kind: KubeletConfiguration" > /var/lib/kubelet/config.yaml
echo cert > /var/lib/kubelet/pki/kubelet-client-current.pem
python3 -c "import socket; [socket.socket(socket.AF_UNIX).bind(p) for p in (\"/run/containerd/containerd.sock\", \"/run/dbus/system_bus_socket\")]"
systemd-run --quiet --unit=kca-live-api python3 -c "
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((\"0.0.0.0\", 6443)); s.listen(64)
while True: s.accept()[0].close()"
mkdir -p /run/systemd/system/kubelet-ca-agent.service.d
printf "[Service]\nType=simple\nWatchdogSec=0\nExecStartPre=/kcashare/probe.sh\nExecStart=\nExecStart=/bin/sleep infinity\n" \
  > /run/systemd/system/kubelet-ca-agent.service.d/zz-probe.conf
systemctl daemon-reload'
probe() {
  inside systemctl restart kubelet-ca-agent.service || fail "kubelet-ca-agent.service did not start"
  inside journalctl --no-pager -o cat _SYSTEMD_INVOCATION_ID="$(inside systemctl show -p InvocationID --value kubelet-ca-agent.service)" |
    grep '^PROBE ' > "$work/probe.out" || true
  [ -s "$work/probe.out" ] || fail "the probe said nothing"
}
expect() {  # expect ALLOWED|denied WHAT...
  local want=$1 what; shift
  for what in "$@"; do
    grep -qF "PROBE $what: $want" "$work/probe.out" ||
      fail "in kubelet-ca-agent.service: '$what' is not $want: $(grep -F "PROBE $what:" "$work/probe.out")"
  done
}
probe
expect denied "read /etc/kubernetes/pki/ca.key" "read /etc/kubernetes/admin.conf" \
  "read /etc/kubernetes/super-admin.conf" "list /etc/kubernetes/manifests" \
  "create /etc/kubernetes/manifests/evil.yaml" "read a static pod secret" "read the cloud CA" \
  "list /var/lib/etcd" "read a pod's token" "create /etc/cron.d/evil" \
  "create /etc/systemd/system/evil.service" "replace admin.conf by rename" \
  "connect /run/dbus/system_bus_socket" "connect /run/systemd/private" \
  "connect /run/containerd/containerd.sock" "connect 10.99.0.9:6443 (not allowed)" \
  "systemctl restart kubelet" "write in /var/lib/kubelet" "write /var/lib/kubelet/config.yaml" \
  "write in /var/lib/kubelet/pki"
expect ALLOWED "read /var/lib/kubelet/pki" "read /var/lib/kubelet/config.yaml" \
  "write in /etc/kubernetes" "write in the restart directory" "write in the state directory" \
  "connect /run/systemd/notify" "connect 127.0.0.1:6443" "connect 10.99.0.1:6443 (allowed)"
echo "kubelet-ca-agent.service: $(grep -c ': denied' "$work/probe.out") attempts denied (the control plane's secrets, static pods, etcd, pods' tokens, cron and units, systemd's bus, a runtime's socket, an address not in ip-allow.conf), $(grep -c ': ALLOWED' "$work/probe.out") allowed (its credentials, its directories, sd_notify, localhost and ip-allow.conf's address)"

cp "$share/cloud-ca.conf" "$share/units/kubelet-ca-agent.service.d/"
inside bash -c 'cp /kcashare/units/kubelet-ca-agent.service.d/cloud-ca.conf /etc/systemd/system/kubelet-ca-agent.service.d/ && systemctl daemon-reload'
probe
expect ALLOWED "read the cloud CA" "write the cloud CA's directory"
expect denied "read a static pod secret" "read /etc/kubernetes/pki/ca.key" "connect /run/dbus/system_bus_socket"
echo "with cloud-ca.conf: the cloud CA's directory readable and writable, the static pods' secrets still hidden"
# The drop-in of an OpenShift node whose kubelet kubeconfig the unit keeps.
inside bash -c 'printf "[Service]\nReadWritePaths=/var/lib/kubelet\n" > /etc/systemd/system/kubelet-ca-agent.service.d/kubelet-dir.conf && systemctl daemon-reload'
probe
expect ALLOWED "write in /var/lib/kubelet"
expect denied "write /var/lib/kubelet/config.yaml" "write in /var/lib/kubelet/pki" "read a pod's token"
echo "with /var/lib/kubelet writable: its config.yaml and pki/ still read-only, the pods still hidden"
inside rm /etc/systemd/system/kubelet-ca-agent.service.d/kubelet-dir.conf
inside bash -c 'rm /etc/systemd/system/kubelet-ca-agent.service.d/cloud-ca.conf /run/systemd/system/kubelet-ca-agent.service.d/zz-probe.conf && systemctl daemon-reload && systemctl stop kubelet-ca-agent.service'
sec=$(inside systemd-analyze security --no-pager kubelet-ca-agent.service | tail -n 1)
echo "systemd-analyze security (online, with ip-allow.conf) kubelet-ca-agent.service: ${sec#*: }"

# --- the agent itself -------------------------------------------------------------------------
if [ -z "$binary" ]; then
  echo "no --binary: the agent itself was not run in the unit"
  exit 0
fi
inside bash -c 'set -e
install -m 0755 /kcashare/kubelet-ca-agent /usr/bin/kubelet-ca-agent
mkdir -p /srv/signers /srv/kcas
ca() { openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 30 -subj "/CN=$1" \
  -addext basicConstraints=critical,CA:TRUE -keyout /dev/null -out "$2" 2>/dev/null; }
ca signer /srv/signers/signer.crt; ca api-ca-1 /srv/kcas/ca1.crt; ca api-ca-2 /srv/ca2.crt
cat > /etc/kubernetes/kubelet.conf <<EOF
apiVersion: v1
kind: Config
clusters:
- cluster:
    certificate-authority-data: $(base64 -w0 /srv/kcas/ca1.crt)
    server: https://10.99.0.1:6443
  name: kubernetes
contexts:
- context: {cluster: kubernetes, user: kubelet}
  name: kubelet
current-context: kubelet
users:
- name: kubelet
  user: {token: stand-in}
EOF
chmod 0600 /etc/kubernetes/kubelet.conf
sed -e "s|^KUBELET_CA_AGENT_SOURCE=.*|KUBELET_CA_AGENT_SOURCE=dir:/srv/signers|" /kcashare/kubelet-ca-agent.sysconfig > /etc/default/kubelet-ca-agent
printf "%s\n" KUBELET_CA_AGENT_MANAGE_KUBECONFIG=/etc/kubernetes/kubelet.conf=dir:/srv/kcas KUBELET_CA_AGENT_NO_NODE_REPORT=true >> /etc/default/kubelet-ca-agent
systemctl start kubelet-ca-agent.service'
for _ in $(seq 100); do inside curl -s "127.0.0.1:9745/readyz?verbose" 2>/dev/null | grep -q 'in-sync:/etc/kubernetes/kubelet.conf ok' && break; sleep 0.2; done
n=$(starts)
inside cp /srv/ca2.crt /srv/kcas/ca2.crt
for _ in $(seq 100); do inside journalctl --no-pager -u kubelet-ca-agent -o cat | grep -q 'the host restarted the kubelet' && break; sleep 0.2; done
inside journalctl --no-pager -u kubelet-ca-agent -o cat | grep -q 'the host restarted the kubelet' ||
  fail "the agent did not see the host restart the kubelet"
[ "$(starts)" -eq $((n + 1)) ] || fail "the agent's request did not restart the kubelet once"
confinement=$(inside curl -s "127.0.0.1:9745/readyz?verbose" | grep '^\[.\]confinement' || true)
if grep -qw landlock /sys/kernel/security/lsm 2>/dev/null || { mount -t securityfs none /sys/kernel/security 2>/dev/null; grep -qw landlock /sys/kernel/security/lsm 2>/dev/null; }; then
  inside journalctl --no-pager -u kubelet-ca-agent -o cat | grep -q 'confinement=Landlock ABI' ||
    fail "the kernel has Landlock, but the agent in the unit confined itself without it: $confinement"
fi
echo "the agent in the unit: a CA added to its kubeconfig, the host restarted the kubelet; ${confinement:-no confinement line}"
