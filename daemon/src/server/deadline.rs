//! A response stream that ends with DEADLINE_EXCEEDED when its call's deadline passes, even
//! while the worker is inside a long step (reads of the model file that come late, a long
//! prompt chunk). The stream then drops its receiver: the worker sees the caller gone at its
//! next check, within one step, and frees the request's sequence.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use tokio::sync::mpsc;
use tokio::time::Sleep;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::Status;

/// What the worker sends, ended at the deadline.
pub struct Deadlined<T> {
    /// `None` once the stream has ended.
    inner: Option<ReceiverStream<Result<T, Status>>>,
    timer: Option<Pin<Box<Sleep>>>,
}

impl<T> Deadlined<T> {
    pub fn new(rx: mpsc::Receiver<Result<T, Status>>, deadline: Option<Instant>) -> Deadlined<T> {
        Deadlined {
            inner: Some(ReceiverStream::new(rx)),
            timer: deadline
                .map(|d| Box::pin(tokio::time::sleep_until(tokio::time::Instant::from_std(d)))),
        }
    }
}

impl<T> Stream for Deadlined<T> {
    type Item = Result<T, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        // What the worker sent before the deadline goes out first.
        if let Poll::Ready(item) = Pin::new(inner).poll_next(cx) {
            if item.is_none() {
                this.inner = None;
            }
            return Poll::Ready(item);
        }
        match this.timer.as_mut().map(|t| t.as_mut().poll(cx)) {
            Some(Poll::Ready(())) => {
                this.inner = None;
                Poll::Ready(Some(Err(Status::deadline_exceeded(
                    "the deadline passed before the request finished",
                ))))
            }
            _ => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio_stream::StreamExt;

    #[tokio::test]
    async fn sent_items_come_first_then_the_deadline_ends_the_stream_and_closes_it() {
        let (tx, rx) = mpsc::channel::<Result<u32, Status>>(4);
        tx.send(Ok(1)).await.unwrap();
        tx.send(Ok(2)).await.unwrap();
        let mut s = Deadlined::new(rx, Some(Instant::now()));
        assert_eq!(s.next().await.unwrap().unwrap(), 1);
        assert_eq!(s.next().await.unwrap().unwrap(), 2);
        // Nothing more is sent (the worker is in a long step): the deadline ends it.
        let end = s.next().await.unwrap().unwrap_err();
        assert_eq!(end.code(), tonic::Code::DeadlineExceeded);
        assert!(s.next().await.is_none());
        assert!(tx.is_closed(), "the worker sees its caller gone");
    }

    #[tokio::test]
    async fn without_a_deadline_the_stream_ends_when_the_worker_does() {
        let (tx, rx) = mpsc::channel::<Result<u32, Status>>(4);
        let mut s = Deadlined::new(rx, None);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            tx.send(Ok(7)).await.unwrap();
        });
        assert_eq!(s.next().await.unwrap().unwrap(), 7);
        assert!(s.next().await.is_none());
    }
}
