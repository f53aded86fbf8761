package engine_test

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/engine"
)

// eventLoad is a closed-loop load on a fleet of engines: concurrency
// requests in flight over all workers, sent round-robin, each a prompt of
// one of prefixes shared prefixes plus a tail of its own.
type eventLoad struct {
	workers, kvBlocks, prefixes, prefixTokens, tailTokens, outputTokens, concurrency int
	requests, warmup                                                                 int // finished requests: measured, and before measuring
}

// BenchmarkEventRates reports the KV block events one worker produces per
// second of the simulator's virtual time (Dynamo's mocker timing): blocks
// stored, blocks removed, their sum (what the index ingests), and KV events
// with their mean blocks. Issue 19: how many workers one Raft group can
// index is the group's committed block events/s over this figure. The
// rates are virtual-time, so deterministic: run with -benchtime 1x.
//
// seed002-k: seed 002's setting (6 workers × 585 blocks, 2,032-token
// prefixes + 339, 64 output tokens, concurrency 8; the simulator's
// calibration runs it). busy-*: production-like, a worker of 29,000 blocks
// (an 8B model's KV in ~60 GB) kept saturated with long prompts until its
// cache is full, so removals match stores.
func BenchmarkEventRates(b *testing.B) {
	loads := []struct {
		name string
		l    eventLoad
	}{
		{"seed002-2", eventLoad{6, 585, 2, 2032, 339, 64, 8, 500, 100}},
		{"seed002-7", eventLoad{6, 585, 7, 2032, 339, 64, 8, 500, 100}},
		{"seed002-12", eventLoad{6, 585, 12, 2032, 339, 64, 8, 500, 100}},
		{"seed002-24", eventLoad{6, 585, 24, 2032, 339, 64, 8, 500, 100}},
		// 8k-token prompts (1k shared), 256 output tokens, 32 in flight per worker.
		{"busy-8k-prompts", eventLoad{4, 29000, 20, 1024, 7168, 256, 128, 1200, 300}},
		// 4k-token prompts (1k shared), 128 output tokens, 64 in flight per worker.
		{"busy-4k-prompts", eventLoad{4, 29000, 20, 1024, 3072, 128, 256, 2400, 600}},
		// chat: 1k-token prompts (half shared), 512 output tokens, 128 in flight
		// per worker; a longer warm-up: its cache fills more slowly.
		{"busy-chat", eventLoad{4, 29000, 20, 512, 512, 512, 512, 3000, 3000}},
	}
	for _, tc := range loads {
		b.Run(tc.name, func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				runEventLoad(b, tc.l)
			}
		})
	}
}

func runEventLoad(b *testing.B, l eventLoad) {
	rng := rand.New(rand.NewPCG(7, 19))
	const bs = 16
	engs := make([]*engine.Engine, l.workers)
	for i := range engs {
		e, err := engine.New(fmt.Sprint("w", i), engine.Config{BlockSize: bs, CapacityBlocks: l.kvBlocks, EngineHashSeed: uint64(i + 1)})
		if err != nil {
			b.Fatal(err)
		}
		engs[i] = e
	}
	sent, next := 0, 0
	submit := func(now time.Duration) {
		p, n := rng.IntN(l.prefixes), l.prefixTokens+l.tailTokens
		hs := make([]uint64, n/bs)
		for i := range hs {
			if (i+1)*bs <= l.prefixTokens {
				hs[i] = 1<<62 | uint64(p)<<32 | uint64(i)
			} else {
				hs[i] = rng.Uint64()
			}
		}
		r := engine.Request{ID: fmt.Sprint("r", sent), NumTokens: n, BlockHashes: hs, OutputTokens: l.outputTokens}
		if err := engs[next%len(engs)].Submit(now, r); err != nil {
			b.Fatal(err)
		}
		sent, next = sent+1, next+1
	}
	for range l.concurrency {
		submit(0)
	}
	var now, t0 time.Duration
	base := make([]engine.Stats, len(engs))
	for done := 0; done < l.warmup+l.requests; {
		now = time.Duration(1 << 62)
		for _, e := range engs {
			if t, ok := e.NextEventTime(); ok && t < now {
				now = t
			}
		}
		if now == 1<<62 {
			b.Fatal("every engine idle with requests outstanding")
		}
		for _, e := range engs {
			for _, o := range e.Advance(now) {
				if o.Kind != engine.Finished {
					continue
				}
				if done++; done == l.warmup {
					t0 = now
					for i, e := range engs {
						base[i] = e.Stats()
					}
				}
				submit(now)
			}
			e.DrainEvents()
		}
	}
	var stored, removed, events uint64
	for i, e := range engs {
		s := e.Stats()
		stored += s.StoredBlocks - base[i].StoredBlocks
		removed += s.EvictedBlocks - base[i].EvictedBlocks
		events += s.Events - base[i].Events
	}
	perWorkerSec := float64(len(engs)) * (now - t0).Seconds()
	b.ReportMetric(float64(stored)/perWorkerSec, "stored/s")
	b.ReportMetric(float64(removed)/perWorkerSec, "removed/s")
	b.ReportMetric(float64(stored+removed)/perWorkerSec, "blockevents/s")
	b.ReportMetric(float64(events)/perWorkerSec, "kvevents/s")
	b.ReportMetric(float64(stored+removed)/float64(max(events, 1)), "blocks/kvevent")
}
