package extproc

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvrouter/kvrouter/router"
)

// BenchmarkExtProcPick is the picker's overhead over the routing decision
// itself, on 16 workers and a chat prompt of ~40 blocks whose prefix one
// worker holds:
//   - decision: api.Server.Pick then Finish, called directly: parse,
//     tokenize, hash, route, book, free (what the proxy does before it
//     sends);
//   - ext_proc: the same request as Envoy drives it in FULL_DUPLEX_STREAMED
//     mode over a loopback TCP gRPC connection, one stream per request:
//     request headers and body in, destination and body back, response
//     headers and one body chunk with end of stream, stream closed.
//
// Each reports its p50 and p99 per request in µs (p50-µs, p99-µs);
// ext_proc also the request phase alone (dest-p50-µs, dest-p99-µs: from
// the request headers sent to the body streamed back, the part a request
// waits for before Envoy connects upstream). The overhead on the request's
// path is dest-p50-µs minus decision's p50-µs.
func BenchmarkExtProcPick(b *testing.B) {
	var workers []*httptest.Server
	for range 16 {
		w := httptest.NewServer(http.NotFoundHandler())
		b.Cleanup(w.Close)
		workers = append(workers, w)
	}
	s := newSide(b, router.DefaultConfig(), workers)
	body := chatBody(prompts[0], true)
	s.rep.store(b, "w5", tokensOf(b, s.srv, body))
	picker := Adapt(s.srv)

	b.Run("decision", func(b *testing.B) {
		ctx := context.Background()
		req := Request{Path: "/v1/chat/completions", Header: http.Header{}, Body: []byte(body), Fallbacks: 2}
		lat := make([]time.Duration, 0, b.N)
		b.ReportAllocs()
		for b.Loop() {
			t0 := time.Now()
			pl, err := picker.Pick(ctx, req)
			if err != nil {
				b.Fatal(err)
			}
			pl.Finish()
			lat = append(lat, time.Since(t0))
		}
		reportPercentiles(b, lat)
	})

	b.Run("ext_proc", func(b *testing.B) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			b.Fatal(err)
		}
		g := grpc.NewServer()
		Register(g, New(Config{Picker: picker}), NewHealth(func() bool { return true }))
		go func() { _ = g.Serve(ln) }()
		b.Cleanup(g.Stop)
		conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { conn.Close() })
		client := extprocv3.NewExternalProcessorClient(conn)
		msgs := []*extprocv3.ProcessingRequest{requestHeaders("/v1/chat/completions", duplex, nil), requestBody([]byte(body), true)}
		answer := []*extprocv3.ProcessingRequest{responseHeaders(200, "", "text/event-stream"), responseBody([]byte(streamAnswer), true)}
		lat := make([]time.Duration, 0, b.N)
		dest := make([]time.Duration, 0, b.N)
		b.ReportAllocs()
		for b.Loop() {
			t0 := time.Now()
			routed, err := exchangeOnce(client, msgs, answer)
			if err != nil {
				b.Fatal(err)
			}
			lat = append(lat, time.Since(t0))
			dest = append(dest, routed.Sub(t0))
		}
		reportPercentiles(b, lat)
		slices.Sort(dest)
		b.ReportMetric(float64(dest[len(dest)/2])/float64(time.Microsecond), "dest-p50-µs")
		b.ReportMetric(float64(dest[int(0.99*float64(len(dest)-1))])/float64(time.Microsecond), "dest-p99-µs")
	})
	if n := s.rep.rt.Load().Len(); n != 0 {
		b.Fatalf("%d bookings left", n)
	}
}

// exchangeOnce runs one request's stream: msgs in, the destination and
// the body back (routed is when the body was back), then the answer's
// messages, each answered, then EOF.
func exchangeOnce(c extprocv3.ExternalProcessorClient, msgs, answer []*extprocv3.ProcessingRequest) (routed time.Time, err error) {
	st, err := c.Process(context.Background())
	if err != nil {
		return routed, err
	}
	for _, m := range msgs {
		if err := st.Send(m); err != nil {
			return routed, err
		}
	}
	for range 2 { // request headers' answer, the body streamed back
		r, err := st.Recv()
		if err != nil {
			return routed, err
		}
		if r.GetImmediateResponse() != nil {
			return routed, fmt.Errorf("refused: %s", r.GetImmediateResponse().GetBody())
		}
	}
	routed = time.Now()
	for _, m := range answer {
		if err := st.Send(m); err != nil {
			return routed, err
		}
		if _, err := st.Recv(); err != nil {
			return routed, err
		}
	}
	if err := st.CloseSend(); err != nil {
		return routed, err
	}
	if _, err := st.Recv(); err != io.EOF {
		return routed, fmt.Errorf("stream end: %v", err)
	}
	return routed, nil
}

func reportPercentiles(b *testing.B, lat []time.Duration) {
	if len(lat) == 0 {
		return
	}
	slices.Sort(lat)
	us := func(q float64) float64 { return float64(lat[int(q*float64(len(lat)-1))]) / float64(time.Microsecond) }
	b.ReportMetric(us(0.5), "p50-µs")
	b.ReportMetric(us(0.99), "p99-µs")
}
