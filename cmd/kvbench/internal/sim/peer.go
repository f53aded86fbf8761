package sim

import (
	"fmt"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/internal/peerpolicy"
	"github.com/kvrouter/kvrouter/router"
)

// A peer policy is another project's scheduler routing the simulated fleet
// in place of the router (internal/peerpolicy runs it in its own process).
// It sees what that scheduler sees in production: each worker's metrics as
// its metrics scraper last read them, refreshed every ScrapeInterval of
// virtual time (not the engines' state at the instant of the decision), and
// the prompt as text.

// PeerPicker is a peer policy: one decision per request (peerpolicy.Client).
type PeerPicker interface {
	Pick(req peerpolicy.Request) (string, error)
}

// PeerPods is the fleet as a peer is told of it once: worker ids and KV
// capacities, in the simulator's worker order.
func PeerPods(workers int, kvBlocks []int) []peerpolicy.PodInfo {
	pods := make([]peerpolicy.PodInfo, workers)
	for i := range pods {
		pods[i] = peerpolicy.PodInfo{Name: WorkerID(i, workers), GPUBlocks: kvBlocks[i]}
	}
	return pods
}

// scrape reads every engine's metrics as a vLLM /metrics endpoint reports
// them: requests waiting and running, and the KV cache's usage (blocks held
// by running requests over capacity, vLLM's kv_cache_usage_perc).
func (s *state) scrape() {
	s.pods = s.pods[:0]
	for i, e := range s.engines {
		st := e.Stats()
		s.pods = append(s.pods, peerpolicy.Pod{Name: string(s.ids[i]), WaitingQueue: st.Waiting, Running: st.Running, KVCacheUsage: st.Fill})
	}
}

// peerScrapeDue is the next scrape time, false when scrapes are not
// simulated (no peer, or metrics read at every decision).
func (s *state) peerScrapeDue() (time.Duration, bool) {
	if s.cfg.Peer == nil || s.cfg.ScrapeInterval <= 0 {
		return 0, false
	}
	return s.nextScrape, true
}

// afterStep takes the scrapes due by now, after the instant's events.
func (s *state) afterStep() {
	if t, ok := s.peerScrapeDue(); ok && s.now >= t {
		s.scrape()
		for s.nextScrape <= s.now {
			s.nextScrape += s.cfg.ScrapeInterval
		}
	}
}

// peerRoute asks the peer for request i's worker.
func (s *state) peerRoute(i int) (router.WorkerID, error) {
	if s.cfg.ScrapeInterval <= 0 {
		s.scrape()
	}
	r := &s.w.Requests[i]
	name, err := s.cfg.Peer.Pick(peerpolicy.Request{ID: r.ID, Model: "sim", Prompt: PeerPrompt(r.Hashes, r.PromptTokens, r.ID, s.w.BlockSize),
		Pods: s.pods})
	if err != nil {
		return "", err
	}
	if _, ok := s.byWorker[router.WorkerID(name)]; !ok {
		return "", fmt.Errorf("peer chose %q, not a worker of the fleet", name)
	}
	return router.WorkerID(name), nil
}

// charsPerToken is the text per token PeerPrompt writes: the 4 characters
// per token that the Gateway API Inference Extension's prefix scorer
// assumes when it sizes its 64-character blocks from a 16-token KV block.
const charsPerToken = 4

// PeerPrompt is a prompt's text for a scheduler that hashes text, not
// tokens: each full KV block is charsPerToken × blockSize characters
// spelled from the block's sequence hash (which covers every block before
// it), so requests share text exactly as far as they share blocks, block
// for block; the partial last block is text of the request's own (id).
func PeerPrompt(hashes []uint64, promptTokens int, id string, blockSize int) string {
	var b strings.Builder
	per := charsPerToken * blockSize
	b.Grow(per*len(hashes) + per)
	for _, h := range hashes {
		fill(&b, fmt.Sprintf("%016x", h), per)
	}
	if tail := promptTokens - len(hashes)*blockSize; tail > 0 {
		fill(&b, "|"+id+"|", charsPerToken*tail)
	}
	return b.String()
}

// fill writes n characters of unit repeated.
func fill(b *strings.Builder, unit string, n int) {
	for n > 0 {
		k := min(n, len(unit))
		b.WriteString(unit[:k])
		n -= k
	}
}
