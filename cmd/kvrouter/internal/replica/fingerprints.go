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

// tokenizerAgreement checks that every replica tokenizes alike: replicas
// behind one load balancer that hash the same request differently split
// one model's traffic into as many disjoint prefix indexes, and each
// replica's own numbers look fine. Each replica reads its peers'
// /cluster/status (the "tokenizers" list: per model, the fingerprint of its
// files) and compares it with its own. A disagreement is a warning log, the
// gauge kvrouter_tokenizer_fingerprint_mismatch{model,peer} = 1 and an
// entry in this replica's /cluster/status ("tokenizer_agreement").
type tokenizerAgreement struct {
	self   string
	client *http.Client
	log    *slog.Logger
	every  time.Duration
	gauge  *prometheus.GaugeVec
	mu     sync.Mutex
	// report: peer → model → "ok" or what differs; mu guards it.
	report map[string]map[string]string
}

func newTokenizerAgreement(self string, reg prometheus.Registerer, log *slog.Logger) *tokenizerAgreement {
	a := &tokenizerAgreement{self: self, client: &http.Client{Timeout: 3 * time.Second}, log: log, every: 30 * time.Second,
		gauge: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvrouter_tokenizer_fingerprint_mismatch",
			Help: "1 when a peer replica's model files (tokenizer, chat template) differ from this replica's: the two hash the same request differently."},
			[]string{"model", "peer"}),
		report: map[string]map[string]string{}}
	reg.MustRegister(a.gauge)
	return a
}

// modelPrints is the comparable part of a status "tokenizers" entry.
type modelPrints map[string]string // model → fingerprint ("none" without files)

func printsOf(entries []map[string]any) modelPrints {
	out := modelPrints{}
	for _, e := range entries {
		model, _ := e["model"].(string)
		fp, _ := e["fingerprint"].(string)
		if fp == "" {
			fp = "none"
		}
		out[model] = fp
	}
	return out
}

// compare lists, per model both replicas know, "ok" or the difference.
func compare(own, peer modelPrints) map[string]string {
	out := map[string]string{}
	for model, fp := range own {
		theirs, ok := peer[model]
		switch {
		case !ok:
			continue // a model the peer has not seen yet: nothing to compare
		case theirs == fp:
			out[model] = "ok"
		default:
			out[model] = fmt.Sprintf("differs: here %s, there %s", fp, theirs)
		}
	}
	return out
}

func (a *tokenizerAgreement) run(ctx context.Context, own func() modelPrints, nodes func() []fsm.NodeRecord) {
	everyPeer(ctx, a.every, a.self, nodes, func(ctx context.Context, id, addr string) { a.check(ctx, own(), id, addr) })
}

func (a *tokenizerAgreement) check(ctx context.Context, own modelPrints, peer, addr string) {
	var st struct {
		Tokenizers []map[string]any `json:"tokenizers"`
	}
	if err := peerStatus(ctx, a.client, addr, false, &st); err != nil {
		a.log.Debug("tokenizer agreement: peer status unavailable", "peer", peer, "err", err)
		return
	}
	a.record(peer, compare(own, printsOf(st.Tokenizers)))
}

func (a *tokenizerAgreement) record(peer string, res map[string]string) {
	a.mu.Lock()
	prev := a.report[peer]
	a.report[peer] = res
	a.mu.Unlock()
	for model, verdict := range res {
		if verdict == "ok" {
			a.gauge.WithLabelValues(model, peer).Set(0)
			continue
		}
		a.gauge.WithLabelValues(model, peer).Set(1)
		if prev[model] != verdict {
			a.log.Warn("replicas tokenize a model differently: the same request hashes to different blocks on each (deploy the same model files everywhere)",
				"model", model, "peer", peer, "fingerprints", verdict)
		}
	}
}

// snapshot is the report for /cluster/status: peer → model → verdict.
func (a *tokenizerAgreement) snapshot() map[string]map[string]string {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make(map[string]map[string]string, len(a.report))
	peers := make([]string, 0, len(a.report))
	for p := range a.report {
		peers = append(peers, p)
	}
	sort.Strings(peers)
	for _, p := range peers {
		out[p] = a.report[p]
	}
	return out
}
