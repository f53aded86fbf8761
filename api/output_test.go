package api

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// outputReplica records the output progress the API announces.
type outputReplica struct {
	*fakeReplica
	mu  sync.Mutex
	out []router.OutputProgress
}

func (o *outputReplica) Output(_, _ string, p router.OutputProgress) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.out = append(o.out, p)
}

func (o *outputReplica) announced() []router.OutputProgress {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]router.OutputProgress(nil), o.out...)
}

// A streamed answer grows its worker's active blocks while it streams
// (--router-track-output-blocks), announces each new output block once,
// and releases everything at its end; with the flag off nothing grows.
func TestAPIStreamTracksOutputBlocks(t *testing.T) {
	for _, track := range []bool{false, true} {
		t.Run(fmt.Sprintf("track=%v", track), func(t *testing.T) { testAPIStreamTracksOutputBlocks(t, track) })
	}
}

func testAPIStreamTracksOutputBlocks(t *testing.T, track bool) {
	const perStep, steps = 20, 2
	next := make(chan struct{})
	worker := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for s := range steps {
			for i := range perStep {
				fmt.Fprintf(w, "data: {\"choices\":[{\"delta\":{\"content\":\"t%d\"}}]}\n\n", s*perStep+i)
			}
			w.(http.Flusher).Flush()
			select {
			case <-next:
			case <-r.Context().Done():
				return
			}
		}
		fmt.Fprintf(w, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":%d}}\n\ndata: [DONE]\n\n", perStep*steps)
	}))
	t.Cleanup(worker.Close)
	cfg := router.DefaultConfig()
	cfg.TrackOutputBlocks = track
	rep := &outputReplica{fakeReplica: newFakeReplica("m", cfg)}
	rep.addWorker("m", "w1", worker.URL)
	s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true}, rep)
	front := httptest.NewServer(s.Handler())
	t.Cleanup(front.Close)

	const osl = 400
	body := fmt.Sprintf(chatBody, fmt.Sprintf(`,"stream":true,"nvext":{"agent_hints":{"osl":%d}}`, osl))
	done := make(chan error, 1)
	go func() {
		resp, err := http.Post(front.URL+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			done <- err
			return
		}
		defer resp.Body.Close()
		_, err = io.Copy(io.Discard, resp.Body)
		done <- err
	}()

	rt, _ := rep.Router("m")
	var booking router.Booking
	poll.Until(t, 5*time.Second, 5*time.Millisecond, func() error {
		bs := rt.Load().Bookings("")
		if len(bs) != 1 {
			return fmt.Errorf("bookings %+v", bs)
		}
		booking = bs[0]
		return nil
	})
	if booking.ExpectedOutput != osl || booking.PromptTokens <= 0 {
		t.Fatalf("booked %+v: want the prompt length and the expected output %d", booking, osl)
	}
	prompt := len(booking.Hashes)
	for step := 1; step <= steps; step++ {
		generated := step * perStep
		want := prompt
		if track {
			out := router.OutputProgress{Blocks: router.OutputBlocks(booking.PromptTokens, generated, cfg.BlockSize),
				Generated: generated, Expected: osl}
			// Every block is the request's own: each counts 1 − generated/osl.
			want = int(float64(prompt+out.Blocks)*(1-out.Decay()) + 0.5)
		}
		poll.Until(t, 5*time.Second, 5*time.Millisecond, func() error {
			if got := rt.Load().Load("w1").ActiveBlocks; got != want {
				return fmt.Errorf("after %d tokens: %d active blocks, want %d", generated, got, want)
			}
			return nil
		})
		next <- struct{}{}
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 5*time.Second, 5*time.Millisecond, func() error {
		if l := rt.Load().Load("w1"); l != (router.WorkerLoad{}) {
			return fmt.Errorf("after the answer: %+v", l)
		}
		return nil
	})
	// At most one announcement per new block (a read that brings several
	// blocks' tokens announces once), each with more blocks than the last,
	// the last with them all.
	got := rep.announced()
	final := 0
	if track {
		final = router.OutputBlocks(booking.PromptTokens, steps*perStep, cfg.BlockSize)
	}
	if len(got) > final || (final > 0 && (len(got) == 0 || got[len(got)-1].Blocks != final)) {
		t.Fatalf("announcements %+v, want at most %d ending at %d blocks", got, final, final)
	}
	for i, o := range got {
		if o.Expected != osl || (i > 0 && o.Blocks <= got[i-1].Blocks) {
			t.Errorf("announcement %d: %+v after %+v", i, o, got[max(i-1, 0)])
		}
	}
}
