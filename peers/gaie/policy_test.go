package gaie

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/internal/peerpolicy"
)

func newPolicy(t testing.TB, seed uint64, blockSize, pods int) *Policy {
	t.Helper()
	in := peerpolicy.Init{Seed: seed, BlockSize: blockSize}
	for i := range pods {
		in.Pods = append(in.Pods, peerpolicy.PodInfo{Name: fmt.Sprintf("w%d", i), GPUBlocks: 4096})
	}
	p, err := New(in)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// idle is n pods with the same metrics: every scorer but the prefix one
// ties.
func idle(n int) []peerpolicy.Pod {
	pods := make([]peerpolicy.Pod, n)
	for i := range pods {
		pods[i] = peerpolicy.Pod{Name: fmt.Sprintf("w%d", i), Running: 2, KVCacheUsage: 0.3}
	}
	return pods
}

// prompt is n characters of text that differ from seed to seed from the
// first character on.
func prompt(seed uint64, n int) string {
	r := rand.New(rand.NewPCG(seed, 1))
	var b strings.Builder
	for b.Len() < n {
		b.WriteString(fmt.Sprintf("%d word%d ", seed, r.IntN(1000)))
	}
	return b.String()[:n]
}

func pick(t testing.TB, p *Policy, id, text string, pods []peerpolicy.Pod) string {
	t.Helper()
	pod, err := p.Pick(peerpolicy.Request{ID: id, Model: "m", Prompt: text, Pods: pods})
	if err != nil {
		t.Fatal(err)
	}
	return pod
}

func TestPolicyPrefixAffinity(t *testing.T) {
	p := newPolicy(t, 1, 16, 8)
	first := map[int]string{}
	for round := range 3 {
		for i := range 10 {
			got := pick(t, p, fmt.Sprintf("r%d-%d", round, i), prompt(uint64(i), 2000), idle(8))
			if round == 0 {
				first[i] = got
			} else if got != first[i] {
				t.Errorf("prompt %d: round %d went to %s, round 0 to %s", i, round, got, first[i])
			}
		}
	}
	// Ten prompts on eight idle pods were spread by the tie-break, not
	// piled on one pod.
	spread := map[string]bool{}
	for _, pod := range first {
		spread[pod] = true
	}
	if len(spread) < 3 {
		t.Errorf("10 new prompts went to only %d pods: %v", len(spread), first)
	}
}

func TestPolicyQueueAndKV(t *testing.T) {
	p := newPolicy(t, 1, 16, 4)
	for i := range 20 {
		pods := idle(4)
		pods[i%4].WaitingQueue = 12 // a long queue on one pod
		for j := range pods {
			if j != i%4 {
				pods[j].WaitingQueue = 1
			}
		}
		if got := pick(t, p, fmt.Sprint("q", i), prompt(uint64(100+i), 2000), pods); got == pods[i%4].Name {
			t.Errorf("request %d: a new prompt went to %s, the pod with the long queue", i, got)
		}
	}
	pods := idle(4)
	pods[0].KVCacheUsage, pods[1].KVCacheUsage, pods[2].KVCacheUsage, pods[3].KVCacheUsage = 0.9, 0.8, 0.1, 0.7
	if got := pick(t, p, "kv", prompt(200, 2000), pods); got != "w2" {
		t.Errorf("equal queues: a new prompt went to %s, not to w2 with the emptiest KV cache", got)
	}
	// The default weights give a full prefix hit (3) more than the queue
	// (2): a cached prompt stays on its pod with the longest queue.
	text := prompt(300, 2000)
	home := pick(t, p, "home", text, idle(4))
	pods = idle(4)
	for i := range pods {
		if pods[i].Name == home {
			pods[i].WaitingQueue = 50
		}
	}
	if got := pick(t, p, "back", text, pods); got != home {
		t.Errorf("a cached prompt left its pod %s for %s over a long queue", home, got)
	}
}

func TestPolicySameSeedSamePicks(t *testing.T) {
	run := func(seed uint64) []string {
		p := newPolicy(t, seed, 16, 16)
		r := rand.New(rand.NewPCG(42, 42)) // the workload: the same for every seed
		var picks []string
		for i := range 300 {
			pods := idle(16)
			for j := range pods {
				pods[j].WaitingQueue = r.IntN(3)
				pods[j].KVCacheUsage = float64(r.IntN(4)) / 4
			}
			// Prompts from 20 shared system prompts with their own tails.
			text := prompt(uint64(r.IntN(20)), 1000) + prompt(uint64(1000+i), 1000)
			picks = append(picks, pick(t, p, fmt.Sprint("r", i), text, pods))
		}
		return picks
	}
	a, b, c := run(1), run(1), run(2)
	for i := range a {
		if a[i] != b[i] {
			t.Fatalf("seed 1 twice: request %d went to %s, then to %s", i, a[i], b[i])
		}
	}
	same := 0
	for i := range a {
		if a[i] == c[i] {
			same++
		}
	}
	if same == len(a) {
		t.Error("seeds 1 and 2 made the same 300 picks: the seed does not reach the tie-break")
	}
}

// TestPolicyPrefixBlockChars confirms the prefix plugin's auto-tune: a
// block is CacheBlockSize x 4 characters, and a prompt shorter than one
// block has no hash to stick by.
func TestPolicyPrefixBlockChars(t *testing.T) {
	sticks := func(blockSize, chars int) bool {
		p := newPolicy(t, 3, blockSize, 8)
		text := prompt(7, chars)
		first := pick(t, p, "r0", text, idle(8))
		for i := 1; i < 20; i++ {
			if pick(t, p, fmt.Sprint("r", i), text, idle(8)) != first {
				return false
			}
		}
		return true
	}
	if !sticks(16, 64) {
		t.Error("block size 16: a 64-character prompt (one 64-character block) does not stick to its pod")
	}
	if sticks(16, 63) {
		t.Error("block size 16: a 63-character prompt sticks (blocks are not 64 characters)")
	}
	if sticks(32, 127) {
		t.Error("block size 32: a 127-character prompt sticks (blocks are not 128 characters)")
	}
}

func TestPolicyRejects(t *testing.T) {
	p := newPolicy(t, 1, 16, 2)
	for _, tt := range []struct {
		name string
		pods []peerpolicy.Pod
		want string
	}{
		{"a percentage for KV usage", []peerpolicy.Pod{{Name: "w0", KVCacheUsage: 45}}, "not in 0..1"},
		{"an unknown pod", []peerpolicy.Pod{{Name: "w9"}}, "not in init"},
		{"a pod twice", []peerpolicy.Pod{{Name: "w0"}, {Name: "w0"}}, "twice"},
		{"no pods", nil, "no candidate"},
	} {
		_, err := p.Pick(peerpolicy.Request{ID: "r", Model: "m", Prompt: "x", Pods: tt.pods})
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: error %v, want one mentioning %q", tt.name, err, tt.want)
		}
	}
	for _, in := range []peerpolicy.Init{
		{BlockSize: 0, Pods: []peerpolicy.PodInfo{{Name: "w0"}}},
		{BlockSize: 16},
		{BlockSize: 16, Pods: []peerpolicy.PodInfo{{Name: "w0"}, {Name: "w0"}}},
	} {
		if _, err := New(in); err == nil {
			t.Errorf("New(%+v) succeeded", in)
		}
	}
}

// BenchmarkPolicyPick is one Schedule plus PreRequest in process, without
// the pipe: what the peer's round trip costs beyond it is the protocol.
func BenchmarkPolicyPick(b *testing.B) {
	for _, n := range []int{16, 100} {
		b.Run(fmt.Sprintf("pods=%d", n), func(b *testing.B) {
			p := newPolicy(b, 1, 16, n)
			reqs := benchRequests(n, 512)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, err := p.Pick(reqs[i%len(reqs)]); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// benchRequests are k requests over n pods with 2,000-character prompts:
// 1,000 characters from one of 32 shared system prompts, 1,000 of their
// own, and varied metrics.
func benchRequests(n, k int) []peerpolicy.Request {
	r := rand.New(rand.NewPCG(9, 9))
	shared := make([]string, 32)
	for i := range shared {
		shared[i] = prompt(uint64(i), 1000)
	}
	reqs := make([]peerpolicy.Request, k)
	for i := range reqs {
		pods := idle(n)
		for j := range pods {
			pods[j].WaitingQueue = r.IntN(8)
			pods[j].Running = r.IntN(32)
			pods[j].KVCacheUsage = r.Float64()
		}
		reqs[i] = peerpolicy.Request{ID: fmt.Sprint("b", i), Model: "m", Prompt: shared[r.IntN(len(shared))] + prompt(uint64(10000+i), 1000), Pods: pods}
	}
	return reqs
}
