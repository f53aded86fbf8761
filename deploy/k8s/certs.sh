#!/usr/bin/env bash
# deploy/k8s/certs.sh — the private CA, certificates and tokens of the
# Kubernetes deployment, as the files kustomization.yaml's generators turn
# into Secrets (kvrouter-tls, kvmock-tls, kvrouter-tokens) and the
# ConfigMap kvrouter-ca. Run it once before `kubectl apply -k deploy/k8s`,
# with the namespace the manifests go to:
#
#   make build                              # bin/kvrouter
#   deploy/k8s/certs.sh my-namespace        # [cluster-domain, default cluster.local]
#   kubectl apply -n my-namespace -k deploy/k8s
#
# It runs `kvrouter certs` (idempotent: the CA and tokens are kept, a
# certificate is reissued only when missing, expired or lacking a host):
#   secrets/ca/   the CA with its key and the originals: keep it here or in
#                 a vault; it never goes into a Secret;
#   secrets/tls/  what the Secrets hold: ca.pem, node-kvrouter-{0,1,2}.pem
#                 and -key.pem, worker-kvmock-{0..3}.pem and -key.pem,
#                 admin-token, replica-token (keys and tokens 0600).
# Node kvrouter-N's certificate names its pod DNS name
# kvrouter-N.kvrouter-peers.<ns>.svc.<domain> (the advertised Raft and HTTP
# host: replicas refuse a certificate without it), the client Service
# (kvrouter, kvrouter.<ns>, kvrouter.<ns>.svc, kvrouter.<ns>.svc.<domain>)
# and localhost / 127.0.0.1 (kubectl port-forward). A certificate is bound
# to a namespace: deploying to another one needs another run (a new
# secrets directory, or the same one: the hosts are added and reissued).
#
# Rotation: rerun, then `kubectl apply -k` again; changed Secrets get new
# hashed names and the StatefulSets roll. For a new CA, remove secrets/
# first, apply, and delete all pods at once (old and new CAs do not trust
# each other, so a rolling update would stall).
#
# Settings (environment; defaults in brackets):
#   KVROUTER_BIN              the kvrouter binary [<repo>/bin/kvrouter]
#   KVROUTER_K8S_SECRETS_DIR  where ca/ and tls/ go [deploy/k8s/secrets]
set -euo pipefail

me=certs.sh
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)

die() {
  echo "$me: $*" >&2
  exit 1
}

[ $# -ge 1 ] && [ $# -le 2 ] || die "usage: $0 NAMESPACE [CLUSTER_DOMAIN]"
ns=$1
domain=${2:-cluster.local}
# Kubernetes namespaces are DNS labels; the domain is a DNS name.
[[ $ns =~ ^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$ ]] || die "namespace '$ns' is not a DNS label"
[[ $domain =~ ^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$ ]] || die "cluster domain '$domain' is not a DNS name"

kvrouter=${KVROUTER_BIN:-$root/bin/kvrouter}
[ -x "$kvrouter" ] || die "$kvrouter is missing: make build (or set KVROUTER_BIN)"
secrets=${KVROUTER_K8S_SECRETS_DIR:-$here/secrets}

# The names in statefulset.yaml, kvmock-statefulset.yaml, service*.yaml and
# kustomization.yaml (three replicas, four workers: change them together).
sts=kvrouter peers=kvrouter-peers svc=kvrouter
n_replicas=3 worker_sts=kvmock n_workers=4

nodes='' workers=''
for ((i = 0; i < n_replicas; i++)); do
  nodes+="${nodes:+,}$sts-$i=$sts-$i.$peers.$ns.svc.$domain"
  nodes+=",$svc,$svc.$ns,$svc.$ns.svc,$svc.$ns.svc.$domain,localhost,127.0.0.1"
done
for ((i = 0; i < n_workers; i++)); do workers+="${workers:+,}$worker_sts-$i"; done

umask 077
"$kvrouter" certs --dir "$secrets/ca" --export "$secrets/tls" \
  --nodes "$nodes" --workers "$workers" --token-files admin-token,replica-token
echo "$me: Secrets' files in $secrets/tls for namespace $ns, domain $domain; the CA key stays in $secrets/ca"
echo "$me: next: kubectl apply -n $ns -k $here"
