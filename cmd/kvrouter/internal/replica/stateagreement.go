package replica

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/fsm"
)

// stateAgreement checks that every replica holds the same replicated
// state, the promise the whole design rests on: each replica reads its
// peers' digest checkpoints (fsm.Checkpoint: the digest right after the
// same log indexes) from /cluster/status and compares the newest one both
// have. An idle cluster writes no entries and so no checkpoints; its
// replicas then stand at one applied index, and the current digests are
// compared instead. A difference is a loud error log, the gauge
// kvrouter_replica_state_mismatch{peer} = 1 and an entry in this replica's
// /cluster/status ("state_agreement"), which the status page shows.
type stateAgreement struct {
	self string
	fsm  *fsm.FSM
	// groups are the data groups of a sharded index (--raft-groups > 1),
	// each compared like the control group (fsm): their reports are keyed
	// "<peer> group <g>" and their gauges labelled group="<g>".
	groups []stateGroup
	client *http.Client
	log    *slog.Logger
	every  time.Duration
	gauge  *prometheus.GaugeVec

	mu     sync.Mutex
	report map[string]stateVerdict // peer → the last comparison
}

// stateGroup is one data group whose state is compared.
type stateGroup struct {
	id  int
	fsm *fsm.FSM
}

// stateVerdict is one peer's comparison, as /cluster/status shows it.
type stateVerdict struct {
	// Verdict is "agree", "differ" or "not compared" (no common index yet).
	Verdict string    `json:"verdict"`
	Index   uint64    `json:"index,omitempty"` // the log index compared at
	Here    string    `json:"digest_here,omitempty"`
	There   string    `json:"digest_there,omitempty"`
	Detail  string    `json:"detail,omitempty"`
	At      time.Time `json:"checked_at"`
}

func newStateAgreement(self string, f *fsm.FSM, reg prometheus.Registerer, log *slog.Logger) *stateAgreement {
	a := &stateAgreement{self: self, fsm: f, client: &http.Client{Timeout: 10 * time.Second}, log: log, every: 30 * time.Second,
		gauge: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvrouter_replica_state_mismatch",
			Help: "1 when a peer replica's state digest differs from this replica's at the same log index: the replicated state diverged."},
			[]string{"peer", "group"}),
		report: map[string]stateVerdict{}}
	reg.MustRegister(a.gauge)
	return a
}

// peerState is what a peer's /cluster/status says about its state: the
// control group's at the top level, each data group's in raft_groups.
type peerState struct {
	Applied     uint64           `json:"applied_index"`
	Digest      string           `json:"digest"`
	Checkpoints []fsm.Checkpoint `json:"digest_checkpoints"`
	Groups      []peerGroupState `json:"raft_groups"`
}

type peerGroupState struct {
	Group       int              `json:"group"`
	Applied     uint64           `json:"applied_index"`
	Digest      string           `json:"digest"`
	Checkpoints []fsm.Checkpoint `json:"digest_checkpoints"`
}

// group is the peer's state of group g (0: the control group).
func (p peerState) group(g int) (peerGroupState, bool) {
	if g == 0 {
		return peerGroupState{Applied: p.Applied, Digest: p.Digest, Checkpoints: p.Checkpoints}, true
	}
	for _, s := range p.Groups {
		if s.Group == g {
			return s, true
		}
	}
	return peerGroupState{}, false
}

func (a *stateAgreement) run(ctx context.Context, nodes func() []fsm.NodeRecord) {
	everyPeer(ctx, a.every, a.self, nodes, a.check)
}

// check compares this replica's state with one peer's, group by group.
func (a *stateAgreement) check(ctx context.Context, peer, addr string) {
	there, err := a.fetch(ctx, addr, false)
	if err != nil {
		a.log.Debug("state agreement: peer status unavailable", "peer", peer, "err", err)
		return
	}
	var withDigest *peerState // fetched once, if some group is idle
	for _, g := range append([]stateGroup{{0, a.fsm}}, a.groups...) {
		pg, ok := there.group(g.id)
		if !ok {
			a.record(peer, g.id, stateVerdict{Verdict: "not compared", Detail: fmt.Sprintf("the peer runs no raft group %d (a different --raft-groups)", g.id), At: time.Now()})
			continue
		}
		v := compareCheckpoints(g.fsm.Checkpoints(), pg.Checkpoints)
		if v.Verdict == "not compared" && pg.Applied == g.fsm.AppliedIndex() {
			// Idle: both at one index. Digest both now (each a copy of
			// the state under its lock, cheap when nothing is being
			// applied) and compare if neither moved meanwhile.
			here, at := g.fsm.Digest(), g.fsm.AppliedIndex()
			if withDigest == nil {
				if st, err := a.fetch(ctx, addr, true); err == nil {
					withDigest = &st
				}
			}
			if withDigest != nil {
				if pd, ok := withDigest.group(g.id); ok && pd.Applied == at && g.fsm.AppliedIndex() == at {
					v = verdictAt(at, here, pd.Digest)
				}
			}
		}
		v.At = time.Now()
		a.record(peer, g.id, v)
	}
}

// compareCheckpoints compares the newest index both lists hold.
func compareCheckpoints(here, there []fsm.Checkpoint) stateVerdict {
	theirs := make(map[uint64]string, len(there))
	for _, c := range there {
		theirs[c.Index] = c.Digest
	}
	for i := len(here) - 1; i >= 0; i-- {
		if d, ok := theirs[here[i].Index]; ok {
			return verdictAt(here[i].Index, here[i].Digest, d)
		}
	}
	detail := "no digest checkpoint in common yet"
	if len(here) > 0 && len(there) > 0 {
		detail = fmt.Sprintf("checkpoints here %d..%d, there %d..%d", here[0].Index, here[len(here)-1].Index, there[0].Index, there[len(there)-1].Index)
	}
	return stateVerdict{Verdict: "not compared", Detail: detail}
}

func verdictAt(index uint64, here, there string) stateVerdict {
	v := stateVerdict{Verdict: "agree", Index: index, Here: here, There: there}
	if here != there {
		v.Verdict = "differ"
	}
	return v
}

// record keeps group g's verdict against peer: keyed by the peer alone
// for the control group (as before sharding), "<peer> group <g>" else.
func (a *stateAgreement) record(peer string, g int, v stateVerdict) {
	key, label := peer, ""
	if g > 0 {
		key, label = fmt.Sprintf("%s group %d", peer, g), strconv.Itoa(g)
	}
	a.mu.Lock()
	prev := a.report[key]
	a.report[key] = v
	a.mu.Unlock()
	switch v.Verdict {
	case "agree":
		a.gauge.WithLabelValues(peer, label).Set(0)
	case "differ":
		a.gauge.WithLabelValues(peer, label).Set(1)
		if prev.Verdict != "differ" {
			a.log.Error("replicated state differs from a peer's at the same log index: the replicas diverged (compare /cluster/status of both; a build skew or a nondeterministic apply)",
				"peer", peer, "group", g, "index", v.Index, "digest_here", v.Here, "digest_there", v.There)
		}
	}
}

func (a *stateAgreement) fetch(ctx context.Context, base string, withDigest bool) (peerState, error) {
	var st peerState
	err := peerStatus(ctx, a.client, base, withDigest, &st)
	return st, err
}

// snapshot is the report for /cluster/status: peer → the last comparison.
func (a *stateAgreement) snapshot() map[string]stateVerdict {
	a.mu.Lock()
	defer a.mu.Unlock()
	peers := make([]string, 0, len(a.report))
	for p := range a.report {
		peers = append(peers, p)
	}
	sort.Strings(peers)
	out := make(map[string]stateVerdict, len(peers))
	for _, p := range peers {
		out[p] = a.report[p]
	}
	return out
}
