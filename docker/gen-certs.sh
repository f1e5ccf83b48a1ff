#!/usr/bin/env bash
# Make what docker/compose.tls.yml needs:
#   OUT/ca.crt, OUT/ca.key               a self-signed CA (keep ca.key off the devices)
#   OUT/server.pem, OUT/server.key       the SuperLink's certificate, SAN: superlink, localhost,
#                                        127.0.0.1 and any extra names/IPs given in SAN_EXTRA
#   OUT/keys/node-I, OUT/keys/node-I.pub ECDSA (P-384) SuperNode keys for I = 0..N-1 (ssh-keygen),
#                                        registered with `flwr supernode register OUT/keys/node-I.pub`
# Usage: docker/gen-certs.sh [OUT=docker/certs] [N=4]
#        SAN_EXTRA="DNS:link.example.org,IP:192.168.1.10" docker/gen-certs.sh
# The default OUT, docker/certs, is git-ignored (.gitignore). An OUT inside a git work tree that
# git would track is refused: private keys never go into a repository's tracked tree.
set -euo pipefail
OUT="${1:-$(dirname "$0")/certs}"
N="${2:-4}"
DAYS="${DAYS:-365}"
SAN="DNS:superlink,DNS:localhost,IP:127.0.0.1${SAN_EXTRA:+,$SAN_EXTRA}"

command -v openssl >/dev/null || { echo "openssl is required" >&2; exit 1; }
command -v ssh-keygen >/dev/null || { echo "ssh-keygen (openssh-client) is required" >&2; exit 1; }

# Is OUT in a git work tree (its nearest existing folder's), and would git track what we write?
case "$OUT" in /*) abs="$OUT" ;; *) abs="$PWD/$OUT" ;; esac
near="$abs"
while [ ! -d "$near" ]; do near="$(dirname "$near")"; done
if command -v git >/dev/null && top="$(git -C "$near" rev-parse --show-toplevel 2>/dev/null)"; then
  for f in ca.key server.key keys/node-0; do
    rc=0; git -C "$near" check-ignore -q "$abs/$f" || rc=$?
    if [ "$rc" -gt 1 ]; then
      echo "gen-certs.sh: git check-ignore could not tell whether $OUT/$f would be tracked (exit $rc)" >&2
      exit 2
    elif [ "$rc" -eq 1 ]; then
      echo "gen-certs.sh: $OUT is inside the git work tree $top and not git-ignored: its private keys" \
           "($f) would be tracked. Write them outside the repository (docker/gen-certs.sh ~/flchurn-certs)" \
           "or into the git-ignored default, docker/certs." >&2
      exit 2
    fi
  done
fi
mkdir -p "$OUT/keys"
cd "$OUT"

openssl req -x509 -newkey rsa:4096 -sha256 -days "$DAYS" -nodes \
  -keyout ca.key -out ca.crt -subj "/CN=flchurn-ca" 2>/dev/null

openssl req -newkey rsa:4096 -sha256 -nodes -keyout server.key -out server.csr \
  -subj "/CN=superlink" 2>/dev/null
printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' \
  "$SAN" > server.ext
openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial \
  -out server.pem -days "$DAYS" -sha256 -extfile server.ext 2>/dev/null
rm -f server.csr server.ext ca.srl

for ((i = 0; i < N; i++)); do
  rm -f "keys/node-$i" "keys/node-$i.pub"
  ssh-keygen -q -t ecdsa -b 384 -N "" -C "flchurn-node-$i" -f "keys/node-$i"
done
chmod 644 ca.crt server.pem keys/*.pub
chmod 600 ca.key server.key
for ((i = 0; i < N; i++)); do chmod 600 "keys/node-$i"; done
# The containers run as uid 1000 (user app): on the Docker host, `sudo chown -R 1000 "$OUT"`
# so they can read the bind-mounted keys (private keys stay mode 600).
echo "wrote $(pwd): ca.crt server.pem server.key keys/node-{0..$((N - 1))}{,.pub} (SAN $SAN)"
