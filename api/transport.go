package api

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"
)

func bytesReader(b []byte) *bytes.Reader { return bytes.NewReader(b) }

// idleConnTimeout is below the keep-alive timeout of the engines' HTTP
// servers (uvicorn, which vLLM and SGLang run, closes idle connections
// after 5 s). A request sent on a connection the worker is closing at that
// moment fails after it was written, and the proxy loop never retries
// such a failure (the worker might have started generating); closing idle
// connections first keeps that race away.
const idleConnTimeout = 4 * time.Second

// newWorkerClient is the client to the workers: a short dial timeout so a
// dead worker is retried elsewhere quickly, no overall timeout (generations
// stream for minutes), idle connections kept for the next request.
// headerTimeout bounds the wait for the answer's headers once the request
// is written (a non-streamed answer's headers come with the whole
// generation, so it is long; 0 = none); a timeout there is a dropped
// request, never retried (failure.go). The dialer refuses local addresses
// unless allowLocal (dialGuard). tlsConf checks https:// workers (nil: the
// system roots).
func newWorkerClient(connect, headerTimeout time.Duration, allowLocal bool, tlsConf *tls.Config) *http.Client {
	d := &net.Dialer{Timeout: connect, KeepAlive: 30 * time.Second, Control: dialGuard(allowLocal)}
	return &http.Client{Transport: &http.Transport{
		TLSClientConfig:       tlsConf,
		DialContext:           d.DialContext,
		MaxIdleConnsPerHost:   256,
		IdleConnTimeout:       idleConnTimeout,
		ResponseHeaderTimeout: max(headerTimeout, 0),
		DisableCompression:    true, // relay bytes exactly as the worker sent them
		// A request goes out in one write when it fits: with Go's 4 KiB
		// default a 16 kB prompt left in five pieces, each waking the
		// engine's reader (on a busy host, each wake-up waits for a CPU)
		// before the last piece, which its time to first token waits for.
		// The cost is this buffer per open worker connection (idle ones
		// close after idleConnTimeout).
		WriteBufferSize: workerWriteBuffer,
	}}
}

// workerWriteBuffer holds a request of ~8,000 tokens of English text whole.
const workerWriteBuffer = 32 << 10

// errWorkerIdle is the cause of an attempt cancelled because the worker
// sent nothing for the idle timeout.
var errWorkerIdle = errors.New("worker sent nothing for the idle timeout")

// idleBody bounds the time one Read of a worker's answer may block: a
// worker that sent its headers and then nothing (hung engine, stalled
// network) has its attempt cancelled after idle, so the relay ends, the
// booking is freed and the connection is closed. Only time blocked in Read
// counts: a slow client holding up our writes is not the worker's fault.
type idleBody struct {
	body   io.ReadCloser
	ctx    context.Context
	cancel context.CancelCauseFunc
	idle   time.Duration
	timer  *time.Timer
}

// newIdleBody wraps body; cancel cancels the attempt's request context.
// idle <= 0 only ties cancel to Close.
func newIdleBody(ctx context.Context, body io.ReadCloser, idle time.Duration, cancel context.CancelCauseFunc) *idleBody {
	b := &idleBody{body: body, ctx: ctx, cancel: cancel, idle: idle}
	if idle > 0 {
		b.timer = time.AfterFunc(idle, func() { cancel(errWorkerIdle) })
		b.timer.Stop()
	}
	return b
}

func (b *idleBody) Read(p []byte) (int, error) {
	if b.timer != nil {
		b.timer.Reset(b.idle)
	}
	n, err := b.body.Read(p)
	if b.timer != nil {
		b.timer.Stop()
	}
	if err != nil && err != io.EOF && errors.Is(context.Cause(b.ctx), errWorkerIdle) {
		err = fmt.Errorf("%w (%s): %w", errWorkerIdle, b.idle, err)
	}
	return n, err
}

func (b *idleBody) Close() error {
	if b.timer != nil {
		b.timer.Stop()
	}
	err := b.body.Close()
	b.cancel(nil)
	return err
}
