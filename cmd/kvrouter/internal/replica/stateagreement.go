package replica

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"sort"
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
	self   string
	fsm    *fsm.FSM
	client *http.Client
	log    *slog.Logger
	every  time.Duration
	gauge  *prometheus.GaugeVec

	mu     sync.Mutex
	report map[string]stateVerdict // peer → the last comparison
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
			[]string{"peer"}),
		report: map[string]stateVerdict{}}
	reg.MustRegister(a.gauge)
	return a
}

// peerState is what a peer's /cluster/status says about its state.
type peerState struct {
	Applied     uint64           `json:"applied_index"`
	Digest      string           `json:"digest"`
	Checkpoints []fsm.Checkpoint `json:"digest_checkpoints"`
}

func (a *stateAgreement) run(ctx context.Context, nodes func() []fsm.NodeRecord) {
	everyPeer(ctx, a.every, a.self, nodes, a.check)
}

// check compares this replica's state with one peer's.
func (a *stateAgreement) check(ctx context.Context, peer, addr string) {
	there, err := a.fetch(ctx, addr, false)
	if err != nil {
		a.log.Debug("state agreement: peer status unavailable", "peer", peer, "err", err)
		return
	}
	v := compareCheckpoints(a.fsm.Checkpoints(), there.Checkpoints)
	if v.Verdict == "not compared" && there.Applied == a.fsm.AppliedIndex() {
		// Idle: both at one index. Digest both now (each a copy of the
		// state under its lock, cheap when nothing is being applied) and
		// compare if neither moved meanwhile.
		here, at := a.fsm.Digest(), a.fsm.AppliedIndex()
		if there, err = a.fetch(ctx, addr, true); err == nil && there.Applied == at && a.fsm.AppliedIndex() == at {
			v = verdictAt(at, here, there.Digest)
		}
	}
	v.At = time.Now()
	a.record(peer, v)
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

func (a *stateAgreement) record(peer string, v stateVerdict) {
	a.mu.Lock()
	prev := a.report[peer]
	a.report[peer] = v
	a.mu.Unlock()
	switch v.Verdict {
	case "agree":
		a.gauge.WithLabelValues(peer).Set(0)
	case "differ":
		a.gauge.WithLabelValues(peer).Set(1)
		if prev.Verdict != "differ" {
			a.log.Error("replicated state differs from a peer's at the same log index: the replicas diverged (compare /cluster/status of both; a build skew or a nondeterministic apply)",
				"peer", peer, "index", v.Index, "digest_here", v.Here, "digest_there", v.There)
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
